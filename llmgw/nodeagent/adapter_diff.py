"""The runtime adapters' pure core: the adapters placed on one engine + what the agent knows
the engine holds + now -> the calls that converge them, and what to report.

The leader places LoRA adapters on replicas (`DesiredShard.adapters`, issue [lora]); the
agent loads and unloads them in the running engine without restarting it (adapter_sync.py
is the shell). Level-triggered like the shard diff (diff.py): handed everything each time, it
returns what to do now, and planning again after the calls took effect returns nothing.

Rules:
- unload what the engine holds and is no longer placed here, or holds from another path than
  the one placed (then load it again from the new one); unloads come first, so a load never
  finds the engine's slots full of adapters on their way out;
- load what is placed and not held, at most as many as the engine has slots. An adapter the
  engine holds and that is still placed is never unloaded to make room for another: when more
  are placed than fit (the leader's error), pinned ones take the free slots first, then the
  rest in the order given, and those left over are reported without a slot;
- a call that failed is not repeated before its `retry_at` (the shell computes it with the
  project's one backoff formula, llmgw.periodic.backoff_delay); the slot of an adapter waiting
  to retry stays reserved, so a retry never finds its place taken by a lower one;
- the profile's own adapters (`Profile.adapters`, loaded at start) are never in `known`: the
  shell leaves them out, and nothing here may touch them.

This module must NOT do I/O, read the clock or import anything that does: `now` and every
fact are passed in, so property tests drive it exactly as the shell does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

# From the module: llmgw.protocol's __init__ does not re-export the runtime adapters' names.
from llmgw.protocol.sync import (
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_RUNTIME_ADAPTERS,
    AdapterObserved,
    AdapterState,
)

__all__ = [
    "AdapterCall",
    "AdapterPlan",
    "KnownAdapter",
    "WantedAdapter",
    "observed_adapters",
    "plan_adapters",
]


@dataclass(frozen=True, slots=True)
class WantedAdapter:
    """One adapter the leader placed on this engine."""

    name: str
    # What the engine is given to load it from: a directory on this node (for an http(s)
    # source, where the agent stores its download), so it compares with what the engine lists.
    path: str
    # Never unloaded to make room for another placed adapter.
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class KnownAdapter:
    """One runtime adapter as the agent knows it on one engine process."""

    name: str
    # loaded: the engine holds it; failed: its last load failed and the engine holds nothing
    # of it (the failure's reason and backoff live here until it loads or is no longer placed).
    state: Literal["loaded", "failed"]
    # The path the engine holds it from; "" when not known (no reload is then asked for).
    path: str = ""
    # Calls for it that failed in a row: loads while it is placed, unloads while it is not.
    failures: int = 0
    # No call for it before this time (the shell's clock).
    retry_at: float = 0.0
    # The last failure's reason (the engine's answer, or the node's own refusal).
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AdapterCall:
    kind: Literal["load", "unload"]
    name: str
    # For a load: the path placed (WantedAdapter.path).
    path: str = ""
    # Why, for the log.
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AdapterPlan:
    # In the order to make them; the shell makes the first and plans again, since each
    # answer may change what comes next.
    calls: tuple[AdapterCall, ...] = ()
    # Placed adapters no slot is left for, with why.
    unplaced: tuple[tuple[str, str], ...] = ()
    # Adapters whose next call waits for its retry_at.
    waiting: tuple[str, ...] = ()
    # Failed loads of adapters no longer placed: the engine holds nothing of them, so the
    # agent drops what it knew.
    forget: tuple[str, ...] = ()
    # The earliest retry_at among the waiting, None when none waits.
    next_retry_at: float | None = None


def _stale(k: KnownAdapter, w: WantedAdapter | None) -> bool:
    """Held from another path than the one placed (a path not known is taken as the same)."""
    return w is not None and bool(k.path) and k.path != w.path


def _holds(k: KnownAdapter | None, w: WantedAdapter) -> bool:
    """Whether the engine holds the placed adapter as placed."""
    return k is not None and k.state == "loaded" and not _stale(k, w)


def plan_adapters(
    wanted: Sequence[WantedAdapter],
    known: Mapping[str, KnownAdapter],
    *,
    slots: int,
    now: float,
) -> AdapterPlan:
    """The calls that move the engine from ``known`` to ``wanted`` within ``slots``."""
    by_name: dict[str, WantedAdapter] = {}
    for one in wanted:
        by_name.setdefault(one.name, one)
    unloads: list[AdapterCall] = []
    waiting: list[str] = []
    forget: list[str] = []
    retry_times: list[float] = []
    # Slots taken by adapters on their way out whose unload waits on backoff.
    held_back = 0
    for name in sorted(known):
        held = known[name]
        placed = by_name.get(name)
        if held.state == "failed":
            if placed is None:
                forget.append(name)
            continue
        if placed is not None and not _stale(held, placed):
            continue
        if held.retry_at > now:
            waiting.append(name)
            retry_times.append(held.retry_at)
            held_back += 1
            continue
        why = (
            "no longer placed here" if placed is None else f"placed from a new path {placed.path!r}"
        )
        unloads.append(AdapterCall("unload", name, reason=why))
    kept = [w for w in by_name.values() if _holds(known.get(w.name), w)]
    free = slots - len(kept) - held_back
    kept_names = {w.name for w in kept}
    # Pinned first, each group in the order placed (sorted() is stable).
    candidates = sorted(
        (w for w in by_name.values() if w.name not in kept_names), key=lambda w: not w.pinned
    )
    loads: list[AdapterCall] = []
    unplaced: list[tuple[str, str]] = []
    for w in candidates:
        k = known.get(w.name)
        if k is not None and k.state == "loaded" and k.retry_at > now:
            # Its old version's unload waits: that slot is counted in held_back already.
            continue
        if free <= 0:
            unplaced.append(
                (
                    w.name,
                    f"no free slot: all {slots} adapter slots of the engine hold other adapters "
                    f"placed here (pinned ones first)",
                )
            )
            continue
        free -= 1
        if k is not None and k.state == "failed" and k.retry_at > now:
            waiting.append(w.name)
            retry_times.append(k.retry_at)
            continue
        loads.append(AdapterCall("load", w.name, path=w.path, reason="placed here, not loaded"))
    return AdapterPlan(
        calls=tuple(unloads + loads),
        unplaced=tuple(unplaced),
        waiting=tuple(waiting),
        forget=tuple(forget),
        next_retry_at=min(retry_times) if retry_times else None,
    )


def _observed(
    name: str, state: AdapterState, reason: str = "", failures: int = 0
) -> AdapterObserved:
    return AdapterObserved(
        name=name,
        state=state,
        reason=reason[:MAX_REASON_CHARS],
        failures=failures,
    )


def observed_adapters(
    wanted: Sequence[WantedAdapter] | None,
    known: Mapping[str, KnownAdapter],
    *,
    slots: int,
    now: float,
    in_flight: AdapterCall | None = None,
    waiting_for: str = "",
) -> tuple[AdapterObserved, ...]:
    """What the shard's binding says of its runtime adapters: every one placed, then every one
    the engine still holds that is not (unloading). Only `loaded` means requests for it may be
    sent. ``wanted`` None: the placement is not known yet (before the first sync), so what the
    engine holds is reported as it is, and nothing as missing. ``waiting_for``: why nothing is
    being done for the placed ones yet (the engine not ready, its list not read), "" when
    calls are under way."""
    out: list[AdapterObserved] = []
    if wanted is None:
        for name in sorted(known):
            if known[name].state == "loaded" and _reportable(name):
                out.append(_observed(name, "loaded"))
        return _bounded(out)
    plan = plan_adapters(wanted, known, slots=slots, now=now)
    unplaced = dict(plan.unplaced)
    seen: set[str] = set()
    for w in wanted:
        if w.name in seen:
            continue
        seen.add(w.name)
        k = known.get(w.name)
        if in_flight is not None and in_flight.name == w.name:
            out.append(_observed(w.name, "loading", k.reason if k else "", k.failures if k else 0))
        elif k is not None and k.state == "loaded" and not _stale(k, w):
            out.append(_observed(w.name, "loaded"))
        elif k is not None and k.state == "failed":
            # No countdown in the reason: a binding that changed on every sync would be
            # written, and NOTIFY every gateway, on every sync.
            out.append(_observed(w.name, "failed", k.reason, k.failures))
        elif w.name in unplaced:
            out.append(_observed(w.name, "failed", unplaced[w.name]))
        elif k is not None and k.state == "loaded":
            out.append(_observed(w.name, "loading", "reloading from its new path", k.failures))
        else:
            out.append(_observed(w.name, "loading", waiting_for))
    for name in sorted(known):
        held = known[name]
        if name in seen or held.state != "loaded" or not _reportable(name):
            continue
        out.append(_observed(name, "unloading", held.reason, held.failures))
    return _bounded(out)


def _bounded(out: list[AdapterObserved]) -> tuple[AdapterObserved, ...]:
    return tuple(out[:MAX_RUNTIME_ADAPTERS])


def _reportable(name: str) -> bool:
    """Whether a name the engine lists fits the protocol's names: one that does not is still
    unloaded when not placed, only never reported."""
    return 0 < len(name) <= MAX_NAME_CHARS
