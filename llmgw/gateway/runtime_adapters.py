"""Runtime LoRA adapters as the gateway routes them (issue [lora], "Routing"): which replicas
serve a declared adapter (``kind: adapter``), why none will, and the hint a 404 gives.

A declared adapter is served by the replicas of its base model whose engine reports it
``loaded`` (``shards.observed_adapters``, written by the agent API from each agent's sync):
never by one still ``loading``, since vLLM answers a request naming an adapter it has not
registered with a 404 the client would see. With none loaded, a request waits in flow control
while the leader places it (``flow``); this module says when that wait cannot succeed:

- every replica the leader chose (``shards.desired_adapters``; where it chose none, every
  replica reporting the adapter at all) reports its load ``failed``: the engine refused the
  path, and the agent's retries will meet the same refusal until an operator fixes it.
  Answering the held requests with the engine's reason beats a 503 "overloaded" after the
  whole ``gateway.queue_timeout_s``, which names nothing to fix;
- no profile of the base model has ``adapter_slots``: the leader places runtime adapters only
  on such replicas, so nothing ever loads it.

What it must NOT do: read the store or a clock (``store.routes`` reads the rows,
``routes.build_table`` calls in here), or call an adapter failed while one replica the leader
chose may still load it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from llmgw.errors import clip
from llmgw.store.routes import AdapterRow, RouteRow

__all__ = [
    "AdapterBlocked",
    "BlockedCode",
    "adapter_blocked",
    "loaded_adapters",
    "unknown_model_hint",
]

# The engine's state that routes requests (``protocol.AdapterState``): a request sent while
# vLLM still loads the adapter finds no such model.
_LOADED = "loaded"
_FAILED = "failed"
# An engine's reason, quoted into an answer: the protocol bounds it at 2 KiB, a client needs
# the start of it.
_REASON_CHARS = 400
# What a 404's hint lists: enough to spot a typo, never the fleet's whole catalog.
_HINT_NAMES = 5
_HINT_BASES = 3
# Names (``protocol.names``) are at most 128 characters: a longer one is no misspelt adapter.
_HINT_MAX_CHARS = 256
# difflib's ratio above which an unknown name reads as a misspelt adapter's.
_CLOSE = 0.75
# An adapter request often spells its base model then a suffix ("llama-8b-sql").
_SEPARATORS = ("-", "_", ".", ":", "/", "@", "+")

BlockedCode = Literal["adapter_load_failed", "adapter_unplaceable"]


@dataclass(frozen=True, slots=True)
class AdapterBlocked:
    """Why a runtime adapter loaded nowhere will not load while a request waits: the code and
    message a held request is answered with (503), at once."""

    code: BlockedCode
    message: str


def loaded_adapters(row: RouteRow, declared: Mapping[str, AdapterRow]) -> dict[str, str]:
    """The declared adapters ``row``'s engine reports loaded: name -> the declared path (what
    the agent loaded it from, so what vLLM hashes with its name into each block's extra keys).
    A name no longer declared is left out: its route is gone, the agent unloads it."""
    out: dict[str, str] = {}
    for observed in row.observed_adapters:
        adapter = declared.get(observed.name)
        if adapter is not None and observed.state == _LOADED:
            out[adapter.name] = adapter.path
    return out


def adapter_blocked(
    adapter: AdapterRow, rows: Sequence[RouteRow], *, slots: bool
) -> AdapterBlocked | None:
    """Pure: why ``adapter`` cannot load on any of ``rows`` (the base model's live rank-0
    shards, ready or not) while a request waits, or None while it may. ``slots``: a profile
    of the base model has adapter_slots (the deployment's or a launched one's)."""
    name, model = adapter.name, adapter.model
    if not slots:
        return AdapterBlocked(
            "adapter_unplaceable",
            f"adapter {name!r} cannot be loaded: no replica of model {model!r} may hold "
            "runtime adapters (adapter_slots is 0 on its profiles); set adapter_slots on its "
            "profile (`llmgw get profiles`), then retry",
        )
    chosen = [r for r in rows if name in r.desired_adapters] or [
        r for r in rows if any(o.name == name for o in r.observed_adapters)
    ]
    failed: list[tuple[str, str]] = []
    for row in sorted(chosen, key=lambda r: r.replica):
        state = next((o for o in row.observed_adapters if o.name == name), None)
        if state is None or state.state != _FAILED:
            return None  # not reported yet, loading or loaded: it may still serve
        failed.append((row.replica, state.reason.strip() or "no reason given"))
    if not failed:
        return None  # not placed yet: the leader's next pass places it
    replica, reason = failed[0]
    more = len(failed) - 1
    also = f" (and on {more} other replica{'s' if more > 1 else ''})" if more else ""
    return AdapterBlocked(
        "adapter_load_failed",
        f"adapter {name!r} failed to load on replica {replica}: {reason[:_REASON_CHARS]}{also}; "
        f"fix its path (`llmgw get adapters {name}`)",
    )


def unknown_model_hint(
    name: str, adapters: Mapping[str, str], usable: Callable[[str], bool]
) -> str:
    """Pure: for a ``model`` no route serves that reads like an adapter request, the adapters
    a key may use that it may have meant ("" when it reads like none). ``adapters``: adapter
    name -> its base model's route name, as the table has them; ``usable``: whether the key
    may use a name (its allow-list). Names the key may not use are never listed.

    It reads like an adapter request when it starts with a base model's name then a separator
    ("m-sql" for base "m"): that base's adapters are listed; else when it is close to an
    adapter's name (a typo): those are."""
    if len(name) > _HINT_MAX_CHARS:
        return ""  # no route's name is this long, and difflib's work grows with it
    mine = {a: base for a, base in adapters.items() if usable(a)}
    if not mine:
        return ""
    bases = sorted(
        {
            b
            for b in mine.values()
            if len(name) > len(b) and name.startswith(b) and name[len(b)] in _SEPARATORS
        }
    )
    if bases:
        names = sorted(a for a, b in mine.items() if b in bases)
    else:
        names = sorted(difflib.get_close_matches(name, mine, n=_HINT_NAMES, cutoff=_CLOSE))
        bases = sorted({mine[a] for a in names})
    if not names:
        return ""
    listed = ", ".join(names[:_HINT_NAMES])
    if len(names) > _HINT_NAMES:
        listed += f" (and {len(names) - _HINT_NAMES} more)"
    of = ", ".join(repr(clip(b)) for b in bases[:_HINT_BASES])
    if len(bases) > _HINT_BASES:
        of += f" (and {len(bases) - _HINT_BASES} more models)"
    return f"adapters of {of} this key may use: {listed}"
