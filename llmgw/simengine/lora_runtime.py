"""The LoRA adapters a simulated engine serves and holds, as vLLM 0.32 keeps them.

vLLM keeps two views of its adapters and an API caller sees both, so both are modelled:

- **registered**: `OpenAIServingModels.lora_requests`
  (`vllm/entrypoints/openai/models/serving.py`). What `/v1/models` lists and what a request's
  `model` may name. It changes only through `--lora-modules` at start,
  `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.
- **held**: the worker's CPU cache (`LRUCacheWorkerLoRAManager.add_adapter`,
  `vllm/lora/worker_manager.py`, over `LRUCache`, `vllm/utils/cache.py`), at most
  `--max-cpu-loras` adapters (default `--max-loras`). A load past that evicts the least
  recently used adapter. An evicted adapter stays registered: the next batch that uses it reads it
  from disk again, which a caller sees only as a slower step. The shell charges that step
  `--lora-load-time-s` per adapter read.

Ids are vLLM's `lora_id_counter`: `--lora-modules` get 1..N in order. Each runtime load of a new
name takes the next id, even when the load then fails, and an id is never handed out twice.
A reload in place (`load_inplace`) keeps its id. With runtime updating on, vLLM also spends an id
on every request naming a model it does not know (`resolve_lora` increments the counter before
asking its resolvers), so `note_unknown_model` does too: KV events carry these ids
(`BlockStored.lora_id`), and they must match what vLLM would publish for the same calls.

Unloading only unregisters, as in vLLM: the adapter's prefix-cache blocks stay cached (its hashes
depend on name and path, not id, so a reload from the same path hits them again). It also
stays in the held cache until it is the LRU victim; vLLM's unload never calls `remove_lora`.

Where the simulator differs from vLLM, and why:

- vLLM evicts the LRU adapter even when a running request uses it, and then reads that adapter
  back from disk on the next step. Here an adapter that a running or paused request uses is never
  evicted. A runtime load that finds every held adapter in use is refused (`LoraSlotsFullError`,
  a 503) instead. The node agent then sees a refusal it can retry, not a batch that thrashes.
- vLLM's scheduler puts at most `--max-loras` adapters in one batch; the simulator's scheduler
  does not model that limit. So a batch may use more adapters than the cache holds. The extras
  are held over the limit and evicted again once no request uses them (vLLM's comment in
  `add_adapter` allows the cache to "very temporarily exceed --max-cpu-loras" too).
- Nothing is pinned: vLLM pins only through the engine's `pin_lora`, which no HTTP route
  reaches, and it does not pin `--lora-modules` (`init_static_loras` loads them as any other).

Must NOT do I/O, read clocks or sleep: the shell passes `now` and a path check in, sleeps until
`PendingLoad.ready_at` and calls `settle`. Unit tests drive it with a plain number as the clock.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmgw.errors import ConflictError, LlmgwError, NotFoundError, SpecError, clip

__all__ = [
    "HeldChange",
    "LoraAdapter",
    "LoraRegistry",
    "LoraRequestCounts",
    "LoraSlotsFullError",
    "PendingLoad",
]


class LoraSlotsFullError(LlmgwError):
    """Every held adapter is in use, so a load has no slot to take. Retry when one is idle."""

    code = "lora-slots-full"


class _NamedPath(Protocol):
    """A `--lora-modules` entry (`config.LoraModule`). A protocol, so that this module does not
    import config.py and what config.py imports."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> str: ...


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    # vLLM's lora_int_id: what KV events carry as `lora_id`.
    lora_id: int
    # As loaded; also the block-hash extra key ("lora", name, path) in vLLM >= 0.31.
    path: str


@dataclass(frozen=True, slots=True)
class HeldChange:
    """What one operation did to the held cache, for the shell to log and time."""

    # Adapters read from "disk" into the cache (a reload of an evicted one, or a new load).
    loaded: tuple[LoraAdapter, ...] = ()
    evicted: tuple[LoraAdapter, ...] = ()


@dataclass(frozen=True, slots=True)
class PendingLoad:
    adapter: LoraAdapter
    # The shell's clock time from which the adapter is registered: `settle(now)` commits it.
    ready_at: float
    # Reloading a registered name in place; the old adapter keeps serving until ready_at.
    in_place: bool
    held: HeldChange


class LoraRegistry:
    """Registered adapters, pending loads and the held LRU cache of one engine."""

    def __init__(
        self,
        static: Sequence[_NamedPath],
        *,
        base_model: str,
        max_cpu_loras: int,
        load_time_s: float,
    ) -> None:
        if max_cpu_loras < 1:
            raise SpecError(
                f"max_cpu_loras={max_cpu_loras}: the cache must hold at least one adapter",
                field="max_cpu_loras",
            )
        self.base_model = base_model
        self.max_cpu_loras = max_cpu_loras
        self.load_time_s = load_time_s
        # next() on itertools.count is atomic, so a request resolved on a worker thread can
        # spend an id (note_unknown_model) while the loop thread loads without either
        # getting an id twice.
        self._ids = itertools.count(1)
        # Insertion order is /v1/models' order. A reload in place keeps its place, as vLLM's dict does.
        self._adapters: dict[str, LoraAdapter] = {}
        self._pending: dict[str, PendingLoad] = {}
        # Every adapter an id was given to, by id: unloaded ones too. Running requests may still
        # use them, and eviction reports them. One small entry per load.
        self._known: dict[int, LoraAdapter] = {}
        # Held ids, least recently used first. Unloaded adapters stay until they are evicted.
        self._held: OrderedDict[int, None] = OrderedDict()
        for module in static:
            adapter = LoraAdapter(module.name, next(self._ids), module.path)
            self._adapters[adapter.name] = adapter
            self._known[adapter.lora_id] = adapter
            # vLLM loads --lora-modules one by one into the same cache. Past its capacity the
            # earlier ones are evicted at start and read again on first use.
            self._make_room(1, protected=set())
            self._held[adapter.lora_id] = None

    # ---- reads (safe from a worker thread: plain dict lookups) ------------------------------

    def get(self, name: str) -> LoraAdapter | None:
        """The registered adapter of that name, the one requests may use."""
        return self._adapters.get(name)

    def require(self, name: str) -> LoraAdapter:
        """The registered adapter a request names, or vLLM's 404 for an unknown model."""
        adapter = self._adapters.get(name)
        if adapter is None:
            raise self.unknown_model(name)
        return adapter

    def unknown_model(self, name: str) -> NotFoundError:
        """vLLM's 404 for a model name it does not serve, listing the names this engine does."""
        # list() copies the names in one step, which the GIL does not interrupt. This may run
        # on a worker thread while the loop thread registers an adapter.
        have = ", ".join([self.base_model, *list(self._adapters)])
        return NotFoundError(
            f"The model `{clip(name)}` does not exist (this engine serves: {have}).",
            field="model",
        )

    def adapters(self) -> tuple[LoraAdapter, ...]:
        """Registered adapters in /v1/models order."""
        return tuple(self._adapters.values())

    def pending_until(self, name: str) -> float | None:
        """When a load of `name` in flight finishes; None when none is."""
        pending = self._pending.get(name)
        return None if pending is None else pending.ready_at

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def held(self) -> tuple[tuple[int, str], ...]:
        """(id, name) of each held adapter, least recently used first."""
        return tuple((i, self._known[i].name) for i in self._held)

    # ---- changes (the loop thread only) ----------------------------------------------------

    def note_unknown_model(self) -> None:
        """Spend an id as vLLM's resolve_lora does for a model name it does not know."""
        next(self._ids)

    def begin_load(
        self,
        name: str,
        path: str,
        *,
        now: float,
        busy: Collection[int],
        path_exists: Callable[[str], bool],
        load_inplace: bool = False,
    ) -> PendingLoad:
        """Start loading `name` from `path`: checks, id, held slot. It registers at ready_at.

        The checks, their order and their messages are vLLM's
        (`_check_load_lora_adapter_request`, then the id, then the engine's load). `busy` is
        the ids running or paused requests use: those are never evicted.
        """
        if name in self._pending:
            # The shell waits for a pending load of the same name first (vLLM's per-name lock).
            raise ConflictError(
                f"LoRA adapter '{clip(name)}' is still loading; wait for that load to finish"
            )
        if not name or not path:
            raise SpecError("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_model:
            raise SpecError(
                f"The lora adapter '{clip(name)}' conflicts with a served base model.",
                field="lora_name",
            )
        existing = self._adapters.get(name)
        if existing is not None and not load_inplace:
            raise SpecError(
                f"The lora adapter '{clip(name)}' has already been loaded. If you want to load "
                "the adapter in place, set 'load_inplace' to True.",
                field="lora_name",
            )
        lora_id = existing.lora_id if existing is not None else next(self._ids)
        adapter = LoraAdapter(name, lora_id, path)
        if not path_exists(path):
            # vLLM's LoRAAdapterNotFoundError: a wrong path is a 404 that names it.
            raise NotFoundError(
                f"Loading lora {clip(name)} failed: No adapter found for {clip(path)}",
                field="lora_path",
            )
        evicted: tuple[LoraAdapter, ...] = ()
        if lora_id in self._held:
            self._held.move_to_end(lora_id)
        else:
            protected = set(busy) | self._pending_ids()
            victims = self._victims(1, protected)
            if victims is None:
                raise self._slots_full(name, protected)
            evicted = self._evict(victims)
            # The slot is taken now, so no reload can fill it while this load runs.
            self._held[lora_id] = None
            self._known.setdefault(lora_id, adapter)
        pending = PendingLoad(
            adapter=adapter,
            ready_at=now + self.load_time_s,
            in_place=existing is not None,
            held=HeldChange(loaded=(adapter,), evicted=evicted),
        )
        self._pending[name] = pending
        return pending

    def settle(self, now: float) -> tuple[LoraAdapter, ...]:
        """Register every pending load whose ready_at has come; the adapters registered."""
        if not self._pending:
            return ()
        done = [p for p in self._pending.values() if p.ready_at <= now]
        for pending in done:
            adapter = pending.adapter
            del self._pending[adapter.name]
            self._adapters[adapter.name] = adapter
            self._known[adapter.lora_id] = adapter
            self._held[adapter.lora_id] = None
            self._held.move_to_end(adapter.lora_id)
        return tuple(p.adapter for p in done)

    def unload(self, name: str) -> LoraAdapter:
        """Unregister `name`. Requests already running with it finish, as in vLLM."""
        if not name:
            raise SpecError("'lora_name' needs to be provided to unload a LoRA adapter.")
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise NotFoundError(
                f"The lora adapter '{clip(name)}' cannot be found.", field="lora_name"
            )
        return adapter

    def activate(
        self, lora_ids: Collection[int], busy: Callable[[], Collection[int]]
    ) -> HeldChange:
        """Put one batch's adapters in the cache, most recently used. An adapter that is not
        held is read again (`loaded`: the shell charges a load time for each one).

        `busy` gives the ids running or paused requests use. It is called only when something
        must be evicted, so a step whose adapters are all held costs one dict move for each.
        """
        missing: list[int] = []
        for lora_id in lora_ids:
            if lora_id in self._held:
                self._held.move_to_end(lora_id)
            else:
                missing.append(lora_id)
        if not missing:
            return HeldChange()
        protected = set(lora_ids) | set(busy()) | self._pending_ids()
        evicted = self._make_room(len(missing), protected)
        for lora_id in missing:
            self._held[lora_id] = None
        return HeldChange(loaded=tuple(self._known[i] for i in missing), evicted=evicted)

    def trim(self, busy: Callable[[], Collection[int]]) -> tuple[LoraAdapter, ...]:
        """Evict what a batch held over the limit, once nothing uses it; the adapters evicted.
        `busy` is called only when the cache is over its limit."""
        if len(self._held) <= self.max_cpu_loras:
            return ()
        return self._make_room(0, set(busy()) | self._pending_ids())

    # ---- internals -------------------------------------------------------------------------

    def _pending_ids(self) -> set[int]:
        return {p.adapter.lora_id for p in self._pending.values()}

    def _victims(self, needed: int, protected: set[int]) -> list[int] | None:
        """The LRU ids to evict so `needed` more fit, or None when too few may be evicted."""
        excess = len(self._held) + needed - self.max_cpu_loras
        if excess <= 0:
            return []
        victims = [i for i in self._held if i not in protected][:excess]
        return victims if len(victims) == excess else None

    def _make_room(self, needed: int, protected: set[int]) -> tuple[LoraAdapter, ...]:
        """Evict as many LRU ids as may go, up to what `needed` more requires."""
        excess = len(self._held) + needed - self.max_cpu_loras
        if excess <= 0:
            return ()
        return self._evict([i for i in self._held if i not in protected][:excess])

    def _evict(self, victims: list[int]) -> tuple[LoraAdapter, ...]:
        for lora_id in victims:
            del self._held[lora_id]
        return tuple(self._known[i] for i in victims)

    def _slots_full(self, name: str, protected: set[int]) -> LoraSlotsFullError:
        in_use = ", ".join(self._known[i].name for i in self._held if i in protected)
        return LoraSlotsFullError(
            f"cannot load LoRA adapter '{clip(name)}': all {self.max_cpu_loras} adapter slots "
            f"(--max-cpu-loras) hold adapters that running requests or other loads use "
            f"({in_use}); retry when one is idle, unload one, or start the engine with a "
            "larger --max-cpu-loras"
        )


class LoraRequestCounts:
    """Unfinished requests per adapter name, in the order vLLM's `LoRARequestStates` keeps them
    (`vllm/v1/metrics/stats.py`). This is what `vllm:lora_requests_info`'s labels list. A name
    is added when its first request arrives and dropped when its last finishes, so a name
    that comes back moves to the end, as in vLLM's dict."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1

    def remove(self, name: str) -> None:
        left = self._counts.get(name, 0) - 1
        if left > 0:
            self._counts[name] = left
        else:
            self._counts.pop(name, None)

    def clear(self) -> None:
        self._counts.clear()

    def names(self) -> tuple[str, ...]:
        return tuple(self._counts)
