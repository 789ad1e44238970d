"""The node agent's KV-event relay: engines' KV events -> mirrors -> every control plane instance.

``KvRelay`` is the agent-facing shell. Ingest (ZMQ, mirrors, replay, persistence) runs on one
thread (ingest.py, replay.py); what and when to send is the pure stream.py; this module runs
one asyncio stream per control plane instance (docs/architecture.md §5):

- at most one request in flight per instance and at most ``max_sends_per_s`` requests a second,
  so a busy engine costs an instance a bounded request rate whatever its event rate: changes
  made while a request is in flight are coalesced into the next one;
- ``POST <internal_url>/agent/v1/kv`` with the node credential and a msgpack body
  (``llmgw.protocol.kvstream``); ``need_full`` schedules a jittered reset, ``retry`` and
  transport errors back off, a 429 waits its Retry-After;
- an empty keepalive delta every ``keepalive_s`` per shard, so an instance that restarted under
  the same id while an engine sat idle learns it lacks the view (it answers ``need_full``).

The agent calls ``watch``/``unwatch`` as the supervisor starts and stops engines (a new
``engine_generation`` = a new engine process, which resets the mirror) and ``set_instances``
from every sync response. Each instance's URL passes the TLS rule of every agent -> control
plane connection (``client.check_url``: https, or loopback, or ``allow_insecure_http``)
before the node credential is sent there; one that fails gets no stream, and an error line
naming the fix. It must NOT import the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiohttp
from prometheus_client import CollectorRegistry

from llmgw.errors import ConfigError
from llmgw.eventloop import cancel_and_wait, wait_event
from llmgw.logs import get_logger
from llmgw.nodeagent.client import check_url
from llmgw.nodeagent.kvrelay.feed import Feed, FrameFilter, WatchSpec
from llmgw.nodeagent.kvrelay.ingest import IngestThread
from llmgw.nodeagent.kvrelay.metrics import RelayMetrics
from llmgw.nodeagent.kvrelay.stream import ShardStream, StreamTiming, plan_requests
from llmgw.protocol.kvstream import (
    KV_CONTENT_TYPE,
    KV_PATH,
    KvStreamError,
    decode_kv_response,
    encode_kv_request,
)

__all__ = ["KvRelay", "RelayView"]

_log = get_logger(__name__)

# What one POST came to: the receiver's verdict (protocol.kvstream.KvResult), a 429, or any
# other failure (transport, status, an unreadable answer). Each is a label of the results metric.
PostOutcome = Literal["ack", "retry", "need_full", "throttled", "error"]


@dataclass(frozen=True, slots=True)
class RelayView:
    """A shard's mirror as the relay holds it (for tests, metrics and debugging)."""

    shard_id: str
    version: int
    partial: bool
    last_seq: int | None
    engine_generation: int
    block_size: int | None
    # (hash64, medium) -> references: physical blocks holding the hash, as the engine reported.
    refcounts: Mapping[tuple[int, str], int]

    @property
    def blocks(self) -> dict[str, frozenset[int]]:
        out: dict[str, set[int]] = {}
        for h, medium in self.refcounts:
            out.setdefault(medium, set()).add(h)
        return {m: frozenset(h) for m, h in out.items()}


@dataclass(slots=True)
class _Instance:
    instance_id: str
    url: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    streams: dict[str, ShardStream] = field(default_factory=dict)
    keepalive_at: dict[str, float] = field(default_factory=dict)
    dirty_since: dict[str, float] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    failing: bool = False  # for logging once per state change, not per attempt
    idle: bool = False  # waiting for news: only then does the ingest thread wake the loop
    cursor: int = 0


class KvRelay:
    """Relays every watched engine's KV view to every live control plane instance."""

    def __init__(
        self,
        *,
        state_dir: Path,
        auth_header: Callable[[], str],
        verify_tls: bool | str = True,
        allow_insecure_http: bool = False,
        registry: CollectorRegistry | None = None,
        max_sends_per_s: float = 10.0,
        keepalive_s: float = 15.0,
        request_timeout_s: float = 10.0,
        timing: StreamTiming | None = None,
        replay_timeout_s: float = 0.5,
        probe_interval_s: float = 30.0,
        persist_interval_s: float = 5.0,
        frame_filter: FrameFilter | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if max_sends_per_s <= 0:
            raise ValueError("max_sends_per_s must be positive")
        self._auth_header = auth_header
        self._verify_tls = verify_tls
        self._allow_insecure_http = allow_insecure_http
        self._refused_urls: set[str] = set()  # logged once while refused, not every sync
        self._min_interval_s = 1.0 / max_sends_per_s
        self._keepalive_s = keepalive_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._timing = timing or StreamTiming()
        self._rand = rand
        self.metrics = RelayMetrics(registry if registry is not None else CollectorRegistry())
        self._ingest = IngestThread(
            state_dir=state_dir,
            metrics=self.metrics,
            on_change=self._changed_from_thread,
            frame_filter=frame_filter,
            replay_timeout_s=replay_timeout_s,
            probe_interval_s=probe_interval_s,
            persist_interval_s=persist_interval_s,
        )
        self._instances: dict[str, _Instance] = {}
        self._wanted_instances: list[tuple[str, str]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._notify_pending = False
        self._started = False
        self._closed = asyncio.Event()

    # --- the agent's calls -------------------------------------------------------------------

    def watch(
        self,
        shard_id: str,
        *,
        sub_port: int,
        replay_port: int | None,
        model: str,
        engine_generation: int,
    ) -> None:
        """Bind ``sub_port`` for this engine (idempotent); a new generation resets its mirror.

        Returns once the SUB is bound and polled, so the caller may start the engine after it.
        """
        spec = WatchSpec(shard_id, sub_port, replay_port or None, model, engine_generation)
        self._ingest.command("watch", spec, wait=self._started)

    def unwatch(self, shard_id: str) -> None:
        """The shard is gone from this node: close its SUB and forget its mirror."""
        self._ingest.command("unwatch", shard_id, wait=self._started)
        for inst in self._instances.values():
            inst.streams.pop(shard_id, None)
            inst.keepalive_at.pop(shard_id, None)
            inst.dirty_since.pop(shard_id, None)

    def set_instances(self, instances: Sequence[tuple[str, str]]) -> None:
        """The live control plane instances (id, internal URL), from the last sync response;
        those whose URL breaks the TLS rule are left out."""
        wanted: list[tuple[str, str]] = []
        refused: set[str] = set()
        for instance_id, url in instances:
            try:
                checked = check_url(
                    url,
                    allow_insecure_http=self._allow_insecure_http,
                    setting="controlplane.advertise_url",
                )
            except ConfigError as exc:
                refused.add(url)
                if url not in self._refused_urls:
                    _log.error(
                        "kv_stream_refused", instance=instance_id, url=url, error=exc.message
                    )
                continue
            wanted.append((instance_id, checked))
        self._refused_urls = refused
        self._wanted_instances = wanted
        if self._loop is not None:
            self._reconcile_instances()

    def view(self, shard_id: str) -> RelayView | None:
        feed = self._ingest.feeds.get(shard_id)
        if feed is None:
            return None
        with feed.lock:
            mirror = feed.mirror
            snapshot = mirror.snapshot()
            refcounts = {
                (h, medium): mirror.refcount(h, medium)
                for medium, hashes in snapshot.blocks.items()
                for h in hashes
            }
            return RelayView(
                shard_id=shard_id,
                version=mirror.version,
                partial=mirror.partial,
                last_seq=mirror.last_seq,
                engine_generation=feed.spec.engine_generation,
                block_size=feed.block_size,
                refcounts=refcounts,
            )

    @property
    def healthy(self) -> bool:
        """False once started if the ingest thread died (no view moves any more): for /healthz."""
        return not self._started or self._ingest.alive

    def instance_versions(self, instance_id: str) -> dict[str, int | None]:
        """Per shard, the version ``instance_id`` acknowledged (None: a full copy is due)."""
        inst = self._instances.get(instance_id)
        return {} if inst is None else {s: st.acked for s, st in inst.streams.items()}

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        ssl_arg: ssl.SSLContext | bool
        if isinstance(self._verify_tls, str):
            ssl_arg = ssl.create_default_context(cafile=self._verify_tls)
        else:
            ssl_arg = bool(self._verify_tls)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ssl_arg, limit=0), timeout=self._timeout
        )
        self._ingest.start()
        self._started = True
        self._reconcile_instances()

    async def run(self) -> None:
        """Start, then run until ``close``."""
        await self.start()
        await self._closed.wait()

    async def close(self) -> None:
        self._closed.set()
        await cancel_and_wait([inst.task for inst in self._instances.values()])
        self._instances.clear()
        # Persists every mirror on the way out, so the next agent forward-fills from replay.
        await asyncio.to_thread(self._ingest.stop)
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._started = False

    def persist_now(self) -> None:
        """Write every mirror to the state dir now (tests; shutdown does it by itself)."""
        self._ingest.command("persist", None, wait=True)

    # --- instances ---------------------------------------------------------------------------

    def _reconcile_instances(self) -> None:
        wanted = dict(self._wanted_instances)
        for instance_id, inst in list(self._instances.items()):
            if wanted.get(instance_id) != inst.url:
                del self._instances[instance_id]
                if inst.task is not None:
                    inst.task.cancel()
                self.metrics.forget_instance(instance_id)
                _log.info("kv_stream_closed", instance=instance_id)
        for instance_id, url in wanted.items():
            if instance_id not in self._instances:
                inst = _Instance(instance_id, url)
                self._instances[instance_id] = inst
                inst.task = asyncio.get_running_loop().create_task(
                    self._stream(inst), name=f"kv-stream-{instance_id}"
                )
                _log.info("kv_stream_opened", instance=instance_id, url=url)

    def _changed_from_thread(self) -> None:
        # At most one cross-thread wake per loop turn, and none unless a stream waits for news:
        # a busy stream picks changes up after its rate-limit pause anyway, and each wake costs
        # the ingest thread the GIL (measured: ~15% of its throughput when waking every round).
        if self._notify_pending or self._loop is None:
            return
        if not any(inst.idle for inst in list(self._instances.values())):
            return
        self._notify_pending = True
        with contextlib.suppress(RuntimeError):  # the loop closed under us
            self._loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        self._notify_pending = False
        for inst in self._instances.values():
            inst.wake.set()

    # --- one instance's stream ---------------------------------------------------------------

    async def _stream(self, inst: _Instance) -> None:
        try:
            while True:
                now = time.monotonic()
                feeds = self._ingest.feeds
                # Idle is declared before looking, so a batch applied after the look finds the
                # flag set and wakes us; one applied before it is seen by the look.
                inst.idle = True
                picked = self._pick(inst, feeds, now)
                if picked is None:
                    inst.wake.clear()
                    wait_s = self._next_due(inst, feeds, now)
                    await wait_event(inst.wake, wait_s)
                    continue
                inst.idle = False
                shard_id, feed, keepalive = picked
                started = time.monotonic()
                await self._send(inst, shard_id, feed, keepalive)
                pause = self._min_interval_s - (time.monotonic() - started)
                if pause > 0:
                    await asyncio.sleep(pause)
        except Exception:
            _log.exception("kv_stream_crashed", instance=inst.instance_id)
            raise

    def _pick(
        self, inst: _Instance, feeds: Mapping[str, Feed], now: float
    ) -> tuple[str, Feed, bool] | None:
        """The next shard to send, round-robin over those with news (or a keepalive due)."""
        names = list(feeds)
        if not names:
            self.metrics.lag.labels(instance=inst.instance_id).set(0)
            return None
        oldest = now
        choice: tuple[str, Feed, bool] | None = None
        for i in range(len(names)):
            shard_id = names[(inst.cursor + i) % len(names)]
            feed = feeds[shard_id]
            stream = inst.streams.get(shard_id)
            if stream is None:
                stream = inst.streams[shard_id] = ShardStream()
                inst.keepalive_at[shard_id] = now + self._keepalive_s
            dirty = stream.acked != feed.mirror.version
            if dirty:
                oldest = min(oldest, inst.dirty_since.setdefault(shard_id, now))
            else:
                inst.dirty_since.pop(shard_id, None)
            if choice is None and stream.due(now):
                if dirty:
                    choice = (shard_id, feed, False)
                elif now >= inst.keepalive_at.get(shard_id, 0.0):
                    choice = (shard_id, feed, True)
                if choice is not None:
                    inst.cursor = (inst.cursor + i + 1) % len(names)
        self.metrics.lag.labels(instance=inst.instance_id).set(now - oldest)
        return choice

    def _next_due(self, inst: _Instance, feeds: Mapping[str, Feed], now: float) -> float:
        due = now + self._keepalive_s
        for shard_id, feed in feeds.items():
            stream = inst.streams.get(shard_id)
            if stream is None:
                return 0.0
            if stream.acked != feed.mirror.version:
                due = min(due, stream.not_before)
            else:
                due = min(due, max(stream.not_before, inst.keepalive_at.get(shard_id, now)))
        return max(0.001, due - now)

    async def _send(self, inst: _Instance, shard_id: str, feed: Feed, keepalive: bool) -> None:
        stream = inst.streams[shard_id]
        with feed.lock:
            requests = plan_requests(
                shard_id, feed.mirror, stream.acked, block_size=feed.block_size, keepalive=keepalive
            )
        inst.keepalive_at[shard_id] = time.monotonic() + self._keepalive_s
        kind = "keepalive" if keepalive else "delta"
        for request in requests:
            if request.reset:
                kind = "full"
            self.metrics.sends.labels(instance=inst.instance_id, kind=kind).inc()
            outcome, retry_after = await self._post(inst, encode_kv_request(request))
            now = time.monotonic()
            self.metrics.results.labels(instance=inst.instance_id, result=outcome).inc()
            if outcome == "ack":
                # Only the last chunk moves the base: an interrupted chunked copy must make the
                # instance answer need_full next time, not pass for a whole view.
                if request.complete:
                    stream.on_ack(request.new_version, now)
                continue
            if outcome == "need_full":
                stream.on_need_full(now, self._rand(), self._timing)
                _log.info("kv_need_full", instance=inst.instance_id, shard=shard_id)
            elif outcome == "throttled":
                stream.on_throttled(now, retry_after, self._rand())
            else:
                stream.on_retry(now, self._rand(), self._timing)
            return

    async def _post(self, inst: _Instance, body: bytes) -> tuple[PostOutcome, float]:
        """POST one body: (ack|retry|need_full|throttled|error, Retry-After seconds)."""
        assert self._session is not None
        try:
            headers = {"Authorization": self._auth_header(), "Content-Type": KV_CONTENT_TYPE}
            async with self._session.post(inst.url + KV_PATH, data=body, headers=headers) as resp:
                data = await resp.content.read(4096)
                if resp.status == 429:
                    return "throttled", _retry_after(resp.headers.get("Retry-After"))
                if resp.status != 200:
                    self._log_failure(inst, f"HTTP {resp.status}: {data[:200]!r}")
                    return "error", 0.0
                result = decode_kv_response(data)
        except (aiohttp.ClientError, TimeoutError, KvStreamError) as exc:
            self._log_failure(inst, f"{type(exc).__name__}: {exc}")
            return "error", 0.0
        if inst.failing:
            inst.failing = False
            _log.info("kv_stream_recovered", instance=inst.instance_id)
        return result, 0.0

    def _log_failure(self, inst: _Instance, error: str) -> None:
        if not inst.failing:
            inst.failing = True
            _log.warning("kv_stream_failing", instance=inst.instance_id, url=inst.url, error=error)


def _retry_after(value: str | None) -> float:
    try:
        return min(300.0, max(0.0, float(value))) if value else 1.0
    except ValueError:
        return 1.0
