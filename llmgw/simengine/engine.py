"""The asyncio shell around the scheduler: runs steps in modelled time, feeds streams, publishes events.

One task steps the pure `Scheduler`; after each step it publishes the step's
KV events at once (so `/debug/kv_blocks` and the last published seq always
describe the same cache), sleeps until the modelled step duration has passed
(counted from the end of the previous step, so the CPU time spent scheduling
and delivering is inside the modelled time, not added to it) and then hands
each request its new token. HTTP handlers only submit, wait on their `RequestStream`, and abort.
With `--kv-transfer-config`, the scheduler looks prompts up in the shared storage
(kv_storage.py) when it admits them, and a producer's step writes the prompts it
completed there on a worker thread while the step's modelled time passes, before their
tokens are delivered: a client that got its answer from the producer finds the blocks
stored.

A stream is woken at most once per step however many tokens it got, and a
handler writes everything pending in one send: that is what keeps the CPU
cost per streamed token low with hundreds of concurrent streams.

Must NOT format HTTP responses (openai_wire.py) or parse requests.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.errors import LlmgwError, SpecError
from llmgw.eventloop import cancel_and_wait
from llmgw.kv.hashing import BlockHash, extra_keys_for_block, hash64, hash_block, none_hash
from llmgw.kv.hf_tokenizer import HfTokenizer
from llmgw.logs import get_logger
from llmgw.simengine.config import SimEngineConfig
from llmgw.simengine.control import ControlSignal, EngineState, apply_signal
from llmgw.simengine.hf_tokens import HfEngineTokenizer, read_tokenizer_dir
from llmgw.simengine.kv_storage import SharedKvStorage
from llmgw.simengine.kv_transfer import KvSave
from llmgw.simengine.lora_runtime import LoraAdapter, LoraRegistry, LoraRequestCounts
from llmgw.simengine.metrics import EngineMetrics
from llmgw.simengine.publisher import KvEventPublisher
from llmgw.simengine.sampling import SampledOutput, Sampler
from llmgw.simengine.scheduler import BlockHasher, RequestSpec, Scheduler, StepResult
from llmgw.simengine.tokenizer import EngineTokenizer, Tokenizer

__all__ = [
    "EngineDeadError",
    "EngineLoadingError",
    "GenerationParams",
    "RequestStream",
    "SimEngine",
    "context_length_error",
]

_log = get_logger(__name__)


class EngineLoadingError(LlmgwError):
    """The engine is still "loading weights" (--load-time-s): answer 503, as a loading vLLM would."""

    code = "engine-loading"


class EngineDeadError(LlmgwError):
    """The step loop failed: /health answers 503 (vLLM's EngineDeadError) so the agent restarts it."""

    code = "engine-dead"


def context_length_error(max_model_len: int, num_prompt: int, field: str) -> SpecError:
    """vLLM's refusal of a prompt that leaves no room for output, naming the prompt's field."""
    return SpecError(
        f"This model's maximum context length is {max_model_len} tokens. However, your request "
        f"has {num_prompt} input tokens. Please reduce the length of the input {field}.",
        field=field,
    )


@dataclass(frozen=True, slots=True)
class GenerationParams:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int | None
    seed: int | None = None
    temperature: float | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    lora_name: str | None = None
    cache_salt: str | None = None
    min_tokens: int | None = None
    # The request fields errors name: "messages" for chat, "max_completion_tokens" when sent.
    prompt_field: str = "prompt"
    max_tokens_field: str = "max_tokens"
    # vLLM's ignore_eos. True, the simulator's rule for completions and chat: max_tokens is
    # the output's length (benchmarks need predictable lengths). False (Responses, Messages,
    # whose clients must send a limit): max_tokens is a ceiling over a drawn natural length,
    # else every answer would be cut at the limit.
    ignore_eos: bool = True


class RequestStream:
    """What a handler holds for one request: tokens appear here as steps complete."""

    __slots__ = (
        "_waiter",
        "aborted",
        "arrival",
        "done",
        "last_token_at",
        "lora_name",
        "num_cached_tokens",
        "num_emitted",
        "num_prompt_tokens",
        "output",
        "request_id",
        "streaming",
    )

    def __init__(
        self, request_id: str, output: SampledOutput, num_prompt_tokens: int, arrival: float
    ) -> None:
        self.request_id = request_id
        self.output = output
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = arrival
        self.num_emitted = 0
        self.num_cached_tokens = 0
        self.done = False
        self.aborted = False
        self.last_token_at = arrival
        # The adapter's name while the request is unfinished (vllm:lora_requests_info counts it).
        self.lora_name: str | None = None
        # A non-streamed response waits for the end only: waking it per token would cost a
        # future and a task switch per token for nothing.
        self.streaming = True
        self._waiter: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        """Until the next step that gives this request a token, finishes or aborts it."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        await waiter

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


def _tokenizer_of(config: SimEngineConfig) -> EngineTokenizer:
    """The model directory's tokenizer files (--tokenizer), else the constructed vocabulary."""
    if config.tokenizer is None:
        return Tokenizer()
    return HfEngineTokenizer(HfTokenizer(read_tokenizer_dir(Path(config.tokenizer))))


class SimEngine:
    def __init__(
        self, config: SimEngineConfig, *, tokenizer: EngineTokenizer | None = None
    ) -> None:
        self.config = config
        self.tokenizer: EngineTokenizer = tokenizer or _tokenizer_of(config)
        self.sampler = Sampler(self.tokenizer, default_seed=config.seed)
        transfer = config.kv_transfer
        self.kv_storage = None if transfer is None else SharedKvStorage(transfer)
        self.scheduler = Scheduler(
            config.scheduler,
            kv_lookup=self.kv_storage.leading_run
            if self.kv_storage is not None and self.kv_storage.transfer.is_consumer
            else None,
            kv_save=self.kv_storage is not None and self.kv_storage.transfer.is_producer,
        )
        self.metrics = EngineMetrics(
            config.served_model_name,
            block_size=config.scheduler.block_size,
            num_blocks=config.scheduler.num_blocks,
            max_loras=config.max_loras if config.lora_enabled else None,
        )
        # Registered and held adapters; the LoRA routes and the step loop change them.
        self.adapters = LoraRegistry(
            config.lora_modules,
            base_model=config.served_model_name,
            max_cpu_loras=config.lora_capacity,
            load_time_s=config.lora_load_time_s,
        )
        self._lora_requests = LoraRequestCounts()
        self.state = EngineState.RUNNING
        self.ready = False
        # Set when the step loop died: requests would otherwise hang forever on a live socket.
        self.dead = False
        self._root = none_hash(config.hash_seed)
        self._publisher = (
            KvEventPublisher(
                config.kv_events, shape=config.kv_events_shape, hash_form=config.kv_events_hash
            )
            if config.kv_events.enabled
            else None
        )
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._hashers: dict[
            tuple[str | None, str | None, str | None],
            tuple[BlockHasher, Callable[[int], Any] | None],
        ] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._publisher is not None:
            self._publisher.start()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        for stream in self._streams.values():
            stream.aborted = True
            stream.wake()
        self._lora_requests.clear()
        if self._publisher is not None:
            await self._publisher.close()

    # ---- requests --------------------------------------------------------------------------

    def submit(self, params: GenerationParams) -> RequestStream:
        if self.dead:
            raise EngineDeadError("the engine's step loop failed; see its log, then restart it")
        if not self.ready:
            raise EngineLoadingError("the engine is loading its model; retry when /health is 200")
        # Resolved when the request was parsed, but an unload may have come in between (while
        # the body was parsed on a worker thread, say): then it is the 404 it would be now.
        adapter = None if params.lora_name is None else self.adapters.require(params.lora_name)
        prompt = params.prompt_token_ids
        room = self._check_limits(params)
        max_tokens = params.max_tokens
        if not params.ignore_eos and max_tokens is not None:
            room, max_tokens = min(room, max_tokens), None
        output = self.sampler.sample(
            prompt,
            max_tokens=max_tokens,
            room=room,
            seed=params.seed,
            temperature=params.temperature,
            stop=params.stop,
            stop_token_ids=params.stop_token_ids,
        )
        hasher, event_extra = self._hasher(adapter, params.cache_salt)
        request_id = str(next(self._ids))
        self.scheduler.add_request(
            RequestSpec(
                request_id=request_id,
                prompt_token_ids=prompt,
                output_token_ids=output.token_ids,
                hasher=hasher,
                lora_name=None if adapter is None else adapter.name,
                lora_id=None if adapter is None else adapter.lora_id,
                event_extra_keys=event_extra,
            )
        )
        stream = RequestStream(request_id, output, len(prompt), asyncio.get_running_loop().time())
        self._streams[request_id] = stream
        if adapter is not None:
            stream.lora_name = adapter.name
            self._lora_requests.add(adapter.name)
        self._wake.set()
        return stream

    def _check_limits(self, params: GenerationParams) -> int:
        """Refuse what could never run BEFORE any output is drawn; the room left for output.

        Sampling materialises the output (the scheduler hashes decode blocks from it), so a
        limit checked after it is no limit: max_tokens=1e9 built a 23.5 GB output before
        max_model_len was compared, and the kernel killed the engine. The checks and their
        wording are vLLM's (serving_engine._validate_input), so clients see the same 400s.
        """
        limit = self.config.scheduler.max_model_len
        num_prompt = len(params.prompt_token_ids)
        if num_prompt >= limit:
            raise context_length_error(limit, num_prompt, params.prompt_field)
        room = limit - num_prompt
        max_tokens = params.max_tokens
        name = params.max_tokens_field
        if max_tokens is not None:
            if max_tokens < 1:
                raise SpecError(f"{name} must be at least 1, got {max_tokens}.", field=name)
            if max_tokens > room:
                raise SpecError(
                    f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                    f"model's maximum context length is {limit} tokens and your request has "
                    f"{num_prompt} input tokens ({max_tokens} > {limit} - {num_prompt}).",
                    field=name,
                )
            # Fits the context, but perhaps not the cache: refused here too, before sampling.
            self.scheduler.check_fits(num_prompt, max_tokens, output_field=name)
        if params.min_tokens is not None:
            ceiling = room if max_tokens is None else max_tokens
            if params.min_tokens > ceiling:
                raise SpecError(
                    f"min_tokens must be less than or equal to max_tokens={ceiling}, "
                    f"got {params.min_tokens}.",
                    field="min_tokens",
                )
        return room

    def abort(self, stream: RequestStream) -> None:
        """Drop a request (client gone) and free its blocks; a no-op once it finished."""
        if self._streams.pop(stream.request_id, None) is None:
            return
        stream.aborted = True
        stream.wake()
        self._request_gone(stream)
        if self.scheduler.abort(stream.request_id):
            _log.info("request_aborted", request=stream.request_id, emitted=stream.num_emitted)
            self.metrics.request_finished("abort")
        self._flush_events()

    def _request_gone(self, stream: RequestStream) -> None:
        if stream.lora_name is not None:
            self._lora_requests.remove(stream.lora_name)
            stream.lora_name = None

    def _hasher(
        self, adapter: LoraAdapter | None, cache_salt: str | None
    ) -> tuple[BlockHasher, Callable[[int], Any] | None]:
        lora_name = None if adapter is None else adapter.name
        lora_path = None if adapter is None else adapter.path
        # The path is part of the key: an adapter unloaded and loaded again from another path
        # hashes its blocks differently (vLLM >= 0.31's tagged extra key carries the path).
        key = (lora_name, lora_path, cache_salt)
        cached = self._hashers.get(key)
        if cached is not None:
            return cached
        keys = {"lora_name": lora_name, "lora_path": lora_path, "cache_salt": cache_salt}
        fmt = self.config.kv_extra_key_format
        first = extra_keys_for_block(0, **keys, extra_key_format=fmt)
        rest = extra_keys_for_block(1, **keys, extra_key_format=fmt)
        root = self._root

        def hasher(parent: BlockHash | None, tokens: tuple[int, ...], index: int) -> BlockHash:
            return hash_block(root if parent is None else parent, tokens, rest if index else first)

        # Events carry extra keys untagged and without the LoRA path in every vLLM that has the
        # field (0.17-0.30 hash that form; 0.31+ publish it): the "legacy" form, either way.
        ev_first = extra_keys_for_block(
            0, lora_name=lora_name, cache_salt=cache_salt, extra_key_format="legacy"
        )
        ev_rest = extra_keys_for_block(
            1, lora_name=lora_name, cache_salt=cache_salt, extra_key_format="legacy"
        )

        # vLLM (0.33 checked) publishes one entry per block even when every entry is None.
        def event_extra(index: int) -> Any:
            return ev_rest if index else ev_first

        pair = (hasher, event_extra)
        if len(self._hashers) > 1024:
            self._hashers.clear()  # salts are per tenant; bound the memo, not the correctness
        self._hashers[key] = pair
        return pair

    # ---- control ---------------------------------------------------------------------------

    def control(self, signal: ControlSignal) -> EngineState:
        before = self.state
        after = apply_signal(before, signal)
        if signal == "suspend" and after != before:
            self.scheduler.suspend()
            self._flush_events()
        self.state = after
        self._update_gauges()
        self._wake.set()
        _log.info("engine_control", signal=signal, state_before=before.value, state=after.value)
        return after

    # ---- introspection ---------------------------------------------------------------------

    def debug_blocks(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "block_size": self.config.scheduler.block_size,
            "blocks": [
                {"hash": hash64(h), "medium": "GPU"} for h in self.scheduler.cached_block_hashes()
            ],
            "seq": None if self._publisher is None else self._publisher.last_seq,
            "kv_events": None
            if self._publisher is None
            else {
                "endpoint": self._publisher.pub_endpoint,
                "replay_endpoint": self._publisher.replay_endpoint,
            },
            "counts": self.scheduler.snapshot_counts(),
        }

    # ---- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception:
            _log.exception("engine_step_failed")
            self.dead = True
            for stream in list(self._streams.values()):
                stream.aborted = True
                stream.wake()
            self._streams.clear()
            self._lora_requests.clear()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self.config.load_time_s > 0:
            await asyncio.sleep(self.config.load_time_s)
        self.ready = True
        _log.info("engine_ready", model=self.config.served_model_name)
        scheduler = self.scheduler
        timing = self.config.timing
        started = loop.time()
        while True:
            if self.state is not EngineState.RUNNING or not scheduler.has_work():
                self._update_gauges()
                self._wake.clear()
                await self._wake.wait()
                started = loop.time()
                continue
            result = scheduler.step()
            self._flush_events()
            delay = (
                started
                + timing.step_duration_s(
                    result.num_prefill_tokens, result.num_decode_seqs, result.num_loaded_tokens
                )
                + (self._activate_adapters(result.lora_ids) if result.lora_ids else 0.0)
                - loop.time()
            )
            if result.kv_saves:
                # Written while the step's time passes (vLLM's connector saves during the
                # forward pass), and done before delivery: an answered prompt is stored.
                await asyncio.gather(
                    asyncio.sleep(delay if delay > 0 else 0), self._save_kv(result.kv_saves)
                )
            else:
                await asyncio.sleep(delay if delay > 0 else 0)
            # The next step's modelled time starts now, before this step's tokens are handed
            # out: delivering (hundreds of socket writes) overlaps the next step as CPU work
            # overlaps GPU work in a real engine. Starting the clock after delivery would make
            # every step longer than modelled, more so the more streams are open.
            started = loop.time()
            self._deliver(result, started)

    async def _save_kv(self, saves: tuple[KvSave, ...]) -> None:
        storage = self.kv_storage
        if storage is None:
            return
        try:
            await asyncio.to_thread(storage.save, saves)
        except OSError as exc:
            # A block not stored is a block the consumer computes: slower, never wrong, so
            # the engine keeps serving (a full disk must not kill the producer).
            _log.warning("kv_store_failed", path=str(storage.path), error=str(exc))

    def _activate_adapters(self, lora_ids: frozenset[int]) -> float:
        """Seconds this step spends reading evicted adapters back, as vLLM's model runner reads
        them before the forward pass and the whole batch waits for it."""
        change = self.adapters.activate(lora_ids, self.scheduler.running_lora_ids)
        if not change.loaded:
            return 0.0
        _log.info(
            "lora_adapters_reloaded",
            adapters=[a.name for a in change.loaded],
            evicted=[a.name for a in change.evicted],
        )
        return len(change.loaded) * self.config.lora_load_time_s

    def _flush_events(self) -> None:
        events = self.scheduler.take_events()
        if events and self._publisher is not None:
            self._publisher.publish(events)

    def _deliver(self, result: StepResult, now: float) -> None:
        streams = self._streams
        metrics = self.metrics
        for request_id, num_cached in result.admitted:
            stream = streams.get(request_id)
            if stream is not None:
                stream.num_cached_tokens = num_cached
        ttft = metrics.time_to_first_token.observe
        itl = metrics.inter_token_latency.observe
        woken: list[RequestStream] = []
        for request_id in result.emitted:
            stream = streams.get(request_id)
            if stream is None:
                continue
            if stream.num_emitted == 0:
                ttft(now - stream.arrival)
            else:
                itl(now - stream.last_token_at)
            stream.num_emitted += 1
            stream.last_token_at = now
            if stream.streaming:
                woken.append(stream)
        for request_id in result.finished:
            stream = streams.pop(request_id, None)
            if stream is None:
                continue
            stream.done = True
            self._request_gone(stream)
            if not stream.streaming:
                woken.append(stream)
            metrics.e2e_request_latency.observe(now - stream.arrival)
            metrics.prompt_tokens.inc(stream.num_prompt_tokens)
            metrics.request_finished(stream.output.finish_reason)
        for stream in woken:
            stream.wake()
        if result.emitted:
            metrics.generation_tokens.inc(len(result.emitted))
        if result.prefix_queries:
            metrics.prefix_cache_queries.inc(result.prefix_queries)
            metrics.prefix_cache_hits.inc(result.prefix_hits)
        if result.external_queries:
            metrics.external_prefix_cache_queries.inc(result.external_queries)
            metrics.external_prefix_cache_hits.inc(result.num_loaded_tokens)
        if result.num_preempted:
            metrics.num_preemptions.inc(result.num_preempted)
        if self.config.lora_enabled:
            metrics.lora_requests(self._lora_requests.names())
            if result.finished:
                self.adapters.trim(self.scheduler.running_lora_ids)
        self._update_gauges()

    def _update_gauges(self) -> None:
        scheduler = self.scheduler
        metrics = self.metrics
        metrics.num_requests_running.set(scheduler.num_running)
        metrics.num_requests_waiting.set(scheduler.num_waiting + scheduler.num_paused)
        metrics.kv_cache_usage_perc.set(scheduler.pool.usage)
