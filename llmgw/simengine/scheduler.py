"""The simulator's scheduler: continuous batching over a paged prefix cache, one step at a time.

Modelled on Megatron-core's DynamicInferenceEngine (reference engines.md
§5.4-5.5), with vLLM's block semantics (block_pool.py):

- FIFO admission, strict head of line, under a per-step token budget
  (`max_num_batched_tokens`, Megatron's max_tokens) and a cap on requests
  holding KV (`max_num_seqs`, Megatron's max_requests). Nothing is admitted
  while a request is paused: a new request would take the blocks the paused
  one is waiting for.
- Chunked prefill: a prompt larger than the step's remaining budget (or the
  free blocks) is prefilled in chunks; at most one chunked request at a
  time, and a chunk never leaves exactly one token (Megatron's rule).
- Prefix reuse: a request's full blocks are hashed with the injected hasher
  (vLLM-identical sha256_cbor in production) and the longest cached run is
  referenced instead of computed, capped at `num_tokens - 1` as vLLM does
  (the last token is always computed, it produces the first output).
- Decode: each running request computes one token per step; when its last
  block is full it needs a new one, and when none is free it is PAUSED
  (keeping its blocks). Paused requests resume LIFO as blocks free.
- When no request can make progress (every holder of blocks is paused or
  stalled) the youngest is preempted: its blocks are freed (they stay in the
  prefix cache) and it is requeued at the front to be recomputed. Without
  this, requests that each fit alone deadlock together.
- A request that could never fit (more blocks than the cache has, longer
  than max_model_len) is refused when added, never queued to wait forever.
- KV transfer (vLLM's KV connector, kv_transfer.py): with `kv_lookup`, a
  request admitted for the first time (or again) also loads the prompt blocks
  past its local hit that the lookup finds, as vLLM's scheduler asks its
  connector; they take blocks like computed ones, count as cached tokens, and
  are reported as `num_loaded_tokens`, never as prefill. With `kv_save`, a
  request's full prompt blocks are reported in `kv_saves` when its prefill
  completes, for the shell to store.

Pure and synchronous: the asyncio shell calls `step()`, sleeps the modelled
duration and delivers the result. Must NOT import asyncio, zmq or do I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from llmgw.errors import ConflictError, SpecError
from llmgw.kv.events import KVEvent
from llmgw.kv.hashing import BlockHash
from llmgw.simengine.block_pool import BlockPool
from llmgw.simengine.kv_transfer import KvSave, lookup_span, prompt_blocks_to_store

__all__ = [
    "BlockHasher",
    "ExternalKvLookup",
    "RequestSpec",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "StepResult",
]

# (parent hash or None for the first block, the block's tokens, block index) -> the block's hash.
BlockHasher = Callable[[BlockHash | None, tuple[int, ...], int], BlockHash]
# A prompt's block hashes past the local hit, in chain order -> how many of the leading ones a
# KV connector holds (vLLM's get_num_new_matched_tokens, in blocks). The shell's reads a
# directory (kv_storage.py); the scheduler only calls it.
ExternalKvLookup = Callable[[Sequence[BlockHash]], int]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int = 4096
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 32768

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise SpecError(
                f"num_blocks={self.num_blocks}: one block is reserved, so at least 2 are needed",
                field="num_blocks",
            )
        for name in ("block_size", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name}={getattr(self, name)} must be >= 1", field=name)
        if self.max_num_batched_tokens < 2:
            # A chunk never leaves exactly one prompt token behind; with a budget of one token
            # every chunk of a longer prompt rounds down to zero and the request never starts.
            raise SpecError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 2 "
                "(a 1-token step budget can never admit a prompt of 2 or more tokens)",
                field="max_num_batched_tokens",
            )


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    # Every token the request will emit, in order: the shell samples them up front (stop strings
    # and EOS already applied), because decode tokens that fill a block are hashed like prompt ones.
    output_token_ids: tuple[int, ...]
    hasher: BlockHasher
    lora_name: str | None = None
    # vLLM's integer id of the adapter (1 for the first --lora-modules entry), carried in events.
    lora_id: int | None = None
    # block index -> the extra_keys entry BlockStored carries for it; None = the field is omitted.
    event_extra_keys: Callable[[int], Any] | None = None


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class _Request:
    spec: RequestSpec
    arrival: int
    all_token_ids: tuple[int, ...]
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    num_output: int = 0
    num_stored_blocks: int = 0
    # Prefix hit at first admission (usage.prompt_tokens_details.cached_tokens); None until admitted.
    num_cached_tokens: int | None = None
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.spec.prompt_token_ids) + self.num_output


@dataclass(frozen=True, slots=True)
class StepResult:
    # Requests that emitted exactly one new token this step, in scheduling order.
    emitted: tuple[str, ...]
    # (request id, prefix-cache hit in tokens) for requests admitted for the first time.
    admitted: tuple[tuple[str, int], ...]
    finished: tuple[str, ...]
    num_prefill_tokens: int
    num_decode_seqs: int
    prefix_queries: int
    prefix_hits: int
    num_paused: int
    num_preempted: int
    # Prompt tokens loaded from the KV connector this step: cached for the request, not prefill
    # (the cost model charges them as a transfer). `external_queries` counts the tokens of the
    # requests looked up, as vLLM's external_prefix_cache_queries does.
    num_loaded_tokens: int = 0
    external_queries: int = 0
    # Prompts whose prefill completed this step, for a producer to store (kv_save only).
    kv_saves: tuple[KvSave, ...] = ()
    # The adapter ids the step's batch used: vLLM puts these in its LoRA cache before the
    # forward pass, so the shell charges a reload for any that was evicted (lora_runtime.py).
    lora_ids: frozenset[int] = frozenset()

    @property
    def is_empty(self) -> bool:
        return self.num_prefill_tokens == 0 and self.num_decode_seqs == 0


class Scheduler:
    """Owns the requests and the block pool; mutated only by add/abort/step/suspend."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        kv_lookup: ExternalKvLookup | None = None,
        kv_save: bool = False,
    ) -> None:
        self.config = config
        self.kv_lookup = kv_lookup
        self.kv_save = kv_save
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._paused: list[_Request] = []  # a stack: the last paused resumes first
        self._chunked: _Request | None = None
        self._arrivals = 0
        self.num_pauses_total = 0
        self.num_preemptions_total = 0

    # ---- requests -------------------------------------------------------------------------

    def check_fits(
        self, num_prompt: int, num_output: int, *, output_field: str = "max_tokens"
    ) -> None:
        """Refuse a request that could never run. The shell calls this with max_tokens before
        sampling, so an impossible request is refused before any output is drawn."""
        cfg = self.config
        if num_prompt < 1:
            raise SpecError("the prompt is empty; send at least one token", field="prompt")
        if num_output < 1:
            raise SpecError(f"{output_field} must be at least 1", field=output_field)
        if num_prompt + num_output > cfg.max_model_len:
            raise SpecError(
                f"this request needs {num_prompt + num_output} tokens ({num_prompt} prompt + "
                f"{num_output} output) but max_model_len is {cfg.max_model_len}; shorten the "
                f"prompt or {output_field}",
                field=output_field,
            )
        # The last output token is never computed, so the request holds at most this many blocks.
        blocks = -(-(num_prompt + num_output - 1) // cfg.block_size)
        if blocks > self.pool.num_usable_blocks:
            raise SpecError(
                f"this request needs {blocks} KV blocks ({num_prompt} prompt + {num_output} "
                f"output tokens at {cfg.block_size} tokens per block) but the cache has only "
                f"{self.pool.num_usable_blocks} usable blocks, so it could never run; shorten "
                f"the prompt or {output_field}, or start the engine with more --num-blocks",
                field=output_field,
            )

    def add_request(self, spec: RequestSpec) -> None:
        if spec.request_id in self._requests:
            raise ConflictError(f"request id {spec.request_id!r} is already active; use a new id")
        self.check_fits(len(spec.prompt_token_ids), len(spec.output_token_ids))
        self._arrivals += 1
        request = _Request(
            spec=spec,
            arrival=self._arrivals,
            all_token_ids=spec.prompt_token_ids + spec.output_token_ids,
        )
        self._requests[spec.request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if it is not active."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status == RequestStatus.WAITING:
            self._waiting.remove(request)
        else:
            self._detach(request)
        request.status = RequestStatus.ABORTED
        return True

    def num_cached_tokens(self, request_id: str) -> int | None:
        request = self._requests.get(request_id)
        return None if request is None else request.num_cached_tokens

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def running_lora_ids(self) -> set[int]:
        """Adapter ids of the requests holding KV (running or paused): the adapters an eviction
        must not take. Waiting requests are left out; vLLM reads their adapters when they run."""
        return {
            r.spec.lora_id for r in (*self._running, *self._paused) if r.spec.lora_id is not None
        }

    def has_work(self) -> bool:
        return bool(self._running or self._paused or self._waiting)

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    # ---- control ---------------------------------------------------------------------------

    def suspend(self) -> None:
        """Free the whole cache (Megatron's recompute mode): active requests requeue at the front."""
        active = sorted([*self._running, *self._paused], key=lambda r: r.arrival)
        for request in active:
            self._detach(request)
            self._reset_for_recompute(request)
        self._waiting.extendleft(reversed(active))
        self.pool.clear()

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> StepResult:
        counters = _StepCounters()
        scheduled = self._schedule(counters)
        # Nothing can move although requests hold blocks: preempt the youngest and try again.
        while not scheduled and (self._running or self._paused):
            victim = max([*self._running, *self._paused], key=lambda r: r.arrival)
            self._detach(victim)
            self._reset_for_recompute(victim)
            self._waiting.appendleft(victim)
            self.num_preemptions_total += 1
            counters.preempted += 1
            scheduled = self._schedule(counters)

        emitted: list[str] = []
        finished: list[str] = []
        lora_ids: set[int] = set()
        saves: list[KvSave] = []
        num_prefill = 0
        num_decode = 0
        for request, num_tokens in scheduled:
            if request.spec.lora_id is not None:
                lora_ids.add(request.spec.lora_id)
            if (
                num_tokens == 1
                and request.num_output > 0
                and request.length - request.num_computed == 1
            ):
                num_decode += 1
            else:
                num_prefill += num_tokens
            request.num_computed += num_tokens
            self._store_full_blocks(request)
            if request.num_computed < request.length:
                continue  # a chunk of a longer prefill
            if request is self._chunked:
                self._chunked = None
            if self.kv_save and request.num_output == 0:
                saves.append(self._kv_save_of(request))
            request.num_output += 1
            emitted.append(request.spec.request_id)
            if request.num_output == len(request.spec.output_token_ids):
                self._detach(request)
                request.status = RequestStatus.FINISHED
                del self._requests[request.spec.request_id]
                finished.append(request.spec.request_id)
        return StepResult(
            emitted=tuple(emitted),
            admitted=tuple(counters.admitted),
            finished=tuple(finished),
            num_prefill_tokens=num_prefill,
            num_decode_seqs=num_decode,
            prefix_queries=counters.queries,
            prefix_hits=counters.hits,
            num_paused=counters.paused,
            num_preempted=counters.preempted,
            num_loaded_tokens=counters.loaded,
            external_queries=counters.external_queries,
            kv_saves=tuple(saves),
            lora_ids=frozenset(lora_ids),
        )

    def _schedule(self, counters: _StepCounters) -> list[tuple[_Request, int]]:
        cfg = self.config
        pool = self.pool
        block_size = cfg.block_size
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[_Request, int]] = []

        while self._paused:
            request = self._paused[-1]
            if (
                self._blocks_for(request.num_computed + 1) - len(request.block_ids)
                > pool.num_free_blocks
            ):
                break
            self._paused.pop()
            request.status = RequestStatus.RUNNING
            self._running.append(request)

        for request in list(self._running):
            if budget == 0:
                break
            pending = request.length - request.num_computed
            if pending == 1:
                if self._blocks_for(request.num_computed + 1) > len(request.block_ids):
                    new = pool.allocate(1)
                    if new is None:
                        self._running.remove(request)
                        request.status = RequestStatus.PAUSED
                        self._paused.append(request)
                        self.num_pauses_total += 1
                        counters.paused += 1
                        continue
                    request.block_ids.extend(new)
                scheduled.append((request, 1))
                budget -= 1
                continue
            num_tokens = self._fit_chunk(
                request, min(pending, budget), pending, pool.num_free_blocks
            )
            if num_tokens == 0:
                continue
            new = pool.allocate(
                self._blocks_for(request.num_computed + num_tokens) - len(request.block_ids)
            )
            assert new is not None
            request.block_ids.extend(new)
            scheduled.append((request, num_tokens))
            budget -= num_tokens

        while (
            self._waiting
            and not self._paused
            and budget > 0
            and len(self._running) + len(self._paused) < cfg.max_num_seqs
        ):
            request = self._waiting[0]
            max_hit_blocks = (request.length - 1) // block_size
            self._ensure_hashes(request, max_hit_blocks)
            hit_ids = pool.match_prefix(request.block_hashes[:max_hit_blocks])
            num_loaded_blocks = self._external_hit(request, len(hit_ids))
            num_hit = (len(hit_ids) + num_loaded_blocks) * block_size
            pending = request.length - num_hit
            free = pool.num_free_blocks - pool.num_unreferenced(hit_ids)
            if self._chunked is None:
                # Loaded blocks need fresh blocks as computed ones do: they count as held at
                # `base`, so they come off the free ones.
                num_tokens = self._fit_chunk(
                    request, min(pending, budget), pending, free - num_loaded_blocks, base=num_hit
                )
            elif pending <= budget and self._blocks_for(request.length) - len(hit_ids) <= free:
                num_tokens = pending
            else:
                num_tokens = 0  # it would need chunking, and one request is already chunked
            if num_tokens == 0:
                break  # strict head of line: FIFO order is the fairness guarantee
            self._waiting.popleft()
            pool.touch(hit_ids)
            new = pool.allocate(self._blocks_for(num_hit + num_tokens) - len(hit_ids))
            assert new is not None
            request.block_ids = [*hit_ids, *new]
            request.num_computed = num_hit
            request.num_stored_blocks = len(hit_ids)
            if request.num_cached_tokens is None:
                # Local and loaded alike, as vLLM's usage counts num_computed_tokens at admission.
                request.num_cached_tokens = num_hit
                counters.admitted.append((request.spec.request_id, num_hit))
            counters.queries += request.length
            counters.hits += len(hit_ids) * block_size
            if self.kv_lookup is not None:
                counters.external_queries += request.length
                counters.loaded += num_loaded_blocks * block_size
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            if num_tokens < pending:
                self._chunked = request
            scheduled.append((request, num_tokens))
            budget -= num_tokens
        return scheduled

    def _external_hit(self, request: _Request, num_local_blocks: int) -> int:
        """Prompt blocks past the local hit that the KV connector holds (0 without one)."""
        if self.kv_lookup is None:
            return 0
        start, end = lookup_span(
            num_local_blocks,
            len(request.spec.prompt_token_ids),
            request.length,
            self.config.block_size,
        )
        if start >= end:
            return 0
        self._ensure_hashes(request, end)
        found = self.kv_lookup(request.block_hashes[start:end])
        return max(0, min(found, end - start))

    def _kv_save_of(self, request: _Request) -> KvSave:
        size = self.config.block_size
        count = prompt_blocks_to_store(len(request.spec.prompt_token_ids), size)
        self._ensure_hashes(request, count)
        return KvSave(
            block_hashes=tuple(request.block_hashes[:count]),
            token_ids=request.spec.prompt_token_ids[: count * size],
            block_size=size,
        )

    def _fit_chunk(
        self,
        request: _Request,
        wanted: int,
        pending: int,
        free_blocks: int,
        *,
        base: int | None = None,
    ) -> int:
        """Tokens of a prefill to compute now: within the budget and the free blocks, never leaving 1."""
        computed = request.num_computed if base is None else base
        held = len(request.block_ids) if base is None else computed // self.config.block_size
        capacity = (held + free_blocks) * self.config.block_size - computed
        num_tokens = min(wanted, capacity)
        if num_tokens < pending and pending - num_tokens == 1:
            # Megatron never leaves a single prompt token for a later chunk.
            num_tokens -= 1
        return max(num_tokens, 0)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _ensure_hashes(self, request: _Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        block_size = self.config.block_size
        tokens = request.all_token_ids
        hasher = request.spec.hasher
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(
                hasher(parent, tokens[index * block_size : (index + 1) * block_size], index)
            )

    def _store_full_blocks(self, request: _Request) -> None:
        block_size = self.config.block_size
        full = request.num_computed // block_size
        stored = request.num_stored_blocks
        if full <= stored:
            return
        self._ensure_hashes(request, full)
        extra = request.spec.event_extra_keys
        self.pool.cache_full_blocks(
            request.block_ids[stored:full],
            request.block_hashes[stored:full],
            parent=request.block_hashes[stored - 1] if stored else None,
            token_ids=request.all_token_ids[stored * block_size : full * block_size],
            lora_name=request.spec.lora_name,
            lora_id=request.spec.lora_id,
            extra_keys=None if extra is None else [extra(i) for i in range(stored, full)],
        )
        request.num_stored_blocks = full

    def _detach(self, request: _Request) -> None:
        """Remove a running or paused request from its list and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
        elif request.status == RequestStatus.PAUSED:
            self._paused.remove(request)
        if request is self._chunked:
            self._chunked = None
        self.pool.free(request.block_ids)
        request.block_ids = []

    def _reset_for_recompute(self, request: _Request) -> None:
        request.status = RequestStatus.WAITING
        request.num_computed = 0
        request.num_stored_blocks = 0

    # ---- introspection ---------------------------------------------------------------------

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.pool.cached_hashes()

    def snapshot_counts(self) -> dict[str, int]:
        return {
            "running": len(self._running),
            "paused": len(self._paused),
            "waiting": len(self._waiting),
            "free_blocks": self.pool.num_free_blocks,
            "pauses_total": self.num_pauses_total,
            "preemptions_total": self.num_preemptions_total,
        }


@dataclass(slots=True)
class _StepCounters:
    queries: int = 0
    hits: int = 0
    paused: int = 0
    preempted: int = 0
    loaded: int = 0
    external_queries: int = 0
    admitted: list[tuple[str, int]] = field(default_factory=list)
