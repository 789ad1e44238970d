"""The KV relay's ingest thread: engines' PUB -> bound SUB -> llmgw.kv mirror, gaps via replay.

One thread owns every ZMQ socket of the relay and polls all SUBs continuously, from the moment
each is bound: a bound SUB attaches a connecting PUB (and sends it the subscription) only while
the socket processes commands, so a SUB read only now and then silently loses an engine's first
batches (libzmq #2267). A thread, not zmq.asyncio: measured in bench/agent_kvrelay.py, draining
with non-blocking receives in one tight loop costs a fraction of an asyncio future per message,
and decoding is the relay's whole budget.

Per engine (``Feed``, feed.py): a topic filter of exactly ``kv@<shard_id>`` (SUB filters by
prefix, so ``kv@s1`` would also take ``kv@s10``; a stopping engine's PUB may reconnect to a
reused port); ``llmgw.kv``'s reference-counting ``BlockMirror``. A seq gap is filled from the
engine's replay ROUTER, on this thread (replay.py). Malformed frames are counted and dropped.
The mirror is persisted atomically in the state dir so a restarted agent forward-fills from
replay instead of starting blind; an engine start the supervisor reports (a new
``engine_generation``) resets it.

Readers on other threads take ``Feed.lock``; nothing else here is shared.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from llmgw.kv import AllBlocksCleared, BlockMirror, KVDecodeError, KVError, decode_batch
from llmgw.logs import get_logger
from llmgw.nodeagent.kvrelay.feed import Feed, FrameFilter, WatchSpec
from llmgw.nodeagent.kvrelay.metrics import RelayMetrics
from llmgw.nodeagent.kvrelay.replay import Replayer
from llmgw.nodeagent.kvrelay.state import load_mirror, move_legacy_state, save_mirror, state_path

__all__ = ["IngestThread"]

_log = get_logger(__name__)

_DRAIN_PER_SOCKET = 512  # messages per socket per poll round: one busy engine cannot starve others
_RCVHWM = 200_000


class IngestThread:
    """Owns the relay's sockets and mirrors; commands arrive through a queue and a wake pipe."""

    def __init__(
        self,
        *,
        state_dir: Path,
        metrics: RelayMetrics,
        on_change: Callable[[], None],
        frame_filter: FrameFilter | None = None,
        replay_timeout_s: float = 0.5,
        probe_interval_s: float = 30.0,
        persist_interval_s: float = 5.0,
        mirror_max_blocks: int = 2_000_000,
    ) -> None:
        self._dir = state_dir / "kv"
        self._metrics = metrics
        self._on_change = on_change
        self._filter = frame_filter
        self._persist_interval_s = persist_interval_s
        self._mirror_max_blocks = mirror_max_blocks
        self.feeds: dict[str, Feed] = {}  # replaced, never mutated, so readers need no lock
        self._commands: queue.SimpleQueue[tuple[str, Any, threading.Event | None]] = (
            queue.SimpleQueue()
        )
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._replayer = Replayer(
            self._ctx,
            metrics,
            on_change=on_change,
            attend_subs=self._attend_subs,
            replay_timeout_s=replay_timeout_s,
            probe_interval_s=probe_interval_s,
        )
        self._thread = threading.Thread(target=self._main, name="kv-relay-ingest", daemon=True)
        self._stopped = False

    # --- commands (any thread) ---------------------------------------------------------------

    def start(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        move_legacy_state(self._dir)
        self._thread.start()

    def command(self, name: str, arg: Any, *, wait: bool = False, timeout_s: float = 10) -> None:
        done = threading.Event() if wait else None
        self._commands.put((name, arg, done))
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        if done is not None and self._thread.is_alive() and not done.wait(timeout_s):
            raise TimeoutError(f"KV relay ingest thread did not run {name!r} in {timeout_s}s")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.command("stop", None)
            self._thread.join(10)
        if not self._stopped:
            self._stopped = True
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._ctx.term()

    # --- the thread --------------------------------------------------------------------------

    def _main(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        by_socket: dict[zmq.Socket[bytes], Feed] = {}
        next_persist = time.monotonic() + self._persist_interval_s
        try:
            while True:
                now = time.monotonic()
                due = min([next_persist, *(f.next_probe_at for f in self.feeds.values())])
                timeout_ms = max(0, int((due - now) * 1000) + 1)
                ready = dict(poller.poll(timeout_ms))
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    if not self._run_commands(poller, by_socket):
                        return
                for sock in list(ready):
                    feed = by_socket.get(sock)
                    if feed is not None:
                        self._drain(feed)
                now = time.monotonic()
                for feed in list(self.feeds.values()):
                    if now >= feed.next_probe_at:
                        self._replayer.probe(feed)
                if now >= next_persist:
                    for feed in list(self.feeds.values()):
                        self._persist(feed)
                    next_persist = now + self._persist_interval_s
        except Exception:
            # Never silently: without this thread no shard's view moves.
            _log.exception("kv_relay_ingest_crashed")
            raise
        finally:
            for feed in self.feeds.values():
                self._persist(feed)
                if feed.sub is not None:
                    feed.sub.close(linger=0)

    def _run_commands(self, poller: zmq.Poller, by_socket: dict[zmq.Socket[bytes], Feed]) -> bool:
        while True:
            try:
                name, arg, done = self._commands.get_nowait()
            except queue.Empty:
                return True
            try:
                if name == "stop":
                    return False
                if name == "watch":
                    self._watch(arg, poller, by_socket)
                elif name == "unwatch":
                    self._unwatch(arg, poller, by_socket)
                elif name == "persist":
                    for feed in self.feeds.values():
                        self._persist(feed)
                elif name == "call":
                    arg()
            except Exception:
                _log.exception("kv_relay_command_failed", command=name)
            finally:
                if done is not None:
                    done.set()

    def _watch(
        self, spec: WatchSpec, poller: zmq.Poller, by_socket: dict[zmq.Socket[bytes], Feed]
    ) -> None:
        feed = self.feeds.get(spec.shard_id)
        if feed is not None and feed.spec == spec:
            return
        if feed is None:
            mirror, block_size = self._load(spec)
            feed = Feed(spec, mirror)
            feed.block_size = block_size
        elif feed.spec.engine_generation != spec.engine_generation:
            with feed.lock:
                feed.mirror.engine_started()
            feed.block_size = None  # the new process may run with another block size
            self._metrics.resets.labels(shard=spec.shard_id, reason="engine_restart").inc()
            _log.info(
                "kv_mirror_reset",
                shard=spec.shard_id,
                reason="engine_restart",
                engine_generation=spec.engine_generation,
            )
        if feed.sub is not None and feed.spec.sub_port != spec.sub_port:
            poller.unregister(feed.sub)
            by_socket.pop(feed.sub, None)
            feed.sub.close(linger=0)
            feed.sub = None
        feed.spec = spec
        if feed.sub is None:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, _RCVHWM)
            sub.setsockopt(zmq.SUBSCRIBE, feed.topic)
            sub.bind(f"tcp://127.0.0.1:{spec.sub_port}")
            # Polled from this instant on: registered before anything else can block the thread.
            poller.register(sub, zmq.POLLIN)
            by_socket[sub] = feed
            feed.sub = sub
        feed.next_probe_at = 0.0
        self.feeds = {**self.feeds, spec.shard_id: feed}
        self._metrics.blocks.labels(shard=spec.shard_id).set(feed.mirror.num_blocks)
        _log.info(
            "kv_relay_watching",
            shard=spec.shard_id,
            sub_port=spec.sub_port,
            replay_port=spec.replay_port,
            engine_generation=spec.engine_generation,
            version=feed.mirror.version,
            last_seq=feed.mirror.last_seq,
        )
        self._on_change()

    def _unwatch(
        self, shard_id: str, poller: zmq.Poller, by_socket: dict[zmq.Socket[bytes], Feed]
    ) -> None:
        feed = self.feeds.get(shard_id)
        if feed is None:
            return
        self.feeds = {k: v for k, v in self.feeds.items() if k != shard_id}
        if feed.sub is not None:
            poller.unregister(feed.sub)
            by_socket.pop(feed.sub, None)
            feed.sub.close(linger=0)
            feed.sub = None
        # The shard is no longer desired here: its engine is gone, and so is the mirror's worth.
        with contextlib.suppress(FileNotFoundError):
            self._path(shard_id).unlink()
        self._metrics.forget_shard(shard_id)
        _log.info("kv_relay_unwatched", shard=shard_id)

    # --- live frames -------------------------------------------------------------------------

    def _drain(self, feed: Feed) -> None:
        """Receive, filter, decode and apply what the SUB holds (the relay's hot loop).

        Kept flat on purpose: counters are summed locally and published once per round, and the
        mirror is locked per batch, so a reader never waits for a whole round.
        """
        sub = feed.sub
        if sub is None:
            return
        shard = feed.spec.shard_id
        m = self._metrics.for_shard(shard)
        topic = feed.topic
        keep = self._filter
        mirror = feed.mirror
        lock = feed.lock
        before = mirror.version
        num_batches = num_events = num_foreign = num_malformed = num_cleared = 0
        for _ in range(_DRAIN_PER_SOCKET):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or frames[0] != topic:
                num_foreign += 1
                continue
            seq_frame = frames[1]
            if len(seq_frame) != 8:
                num_malformed += 1
                continue
            seq = int.from_bytes(seq_frame, "big")
            if keep is not None and not keep(shard, seq):
                continue
            try:
                decoded = decode_batch(frames[2])
            except KVDecodeError as exc:
                num_malformed += 1
                _log.debug("kv_frame_malformed", shard=shard, seq=seq, error=str(exc))
                continue
            batch = decoded.batch
            num_batches += 1
            for event in batch.events:
                if type(event) is AllBlocksCleared:
                    num_cleared += 1
                else:
                    num_events += len(event.block_hashes)  # type: ignore[union-attr]
            if feed.block_size is None:  # checked here too: the common case costs no call
                feed.learn_block_size((batch,))
            with lock:
                outcome = mirror.apply(seq, batch).outcome
            if outcome == "gap":
                self._replayer.fill_gap(feed, seq, decoded)
        if num_batches:
            feed.last_live_at = time.monotonic()
            m.batches.inc(num_batches)
            m.block_events.inc(num_events)
            m.blocks.set(mirror.num_blocks)
        if num_foreign:
            m.foreign.inc(num_foreign)
        if num_malformed:
            m.malformed.inc(num_malformed)
        if num_cleared:
            m.cleared.inc(num_cleared)
        if mirror.num_unknown_medium_blocks != feed.unknown_medium_blocks:
            self._count_unknown_media(feed)
        if mirror.version != before:
            self._on_change()

    def _count_unknown_media(self, feed: Feed) -> None:
        """Count blocks the mirror dropped for their unknown medium (live or replayed since the
        last count), and say so once per engine: not fatal, but a tier no router scores."""
        mirror = feed.mirror
        new = mirror.num_unknown_medium_blocks - feed.unknown_medium_blocks
        feed.unknown_medium_blocks = mirror.num_unknown_medium_blocks
        if new <= 0:
            return
        shard = feed.spec.shard_id
        self._metrics.unknown_media.labels(shard=shard).inc(new)
        if not feed.warned_unknown_medium:
            feed.warned_unknown_medium = True
            _log.warning(
                "kv_unknown_medium",
                shard=shard,
                medium=mirror.last_unknown_medium,
                blocks=new,
                hint="the engine stores blocks on a tier llmgw does not know (it knows "
                "GPU, CPU, STORAGE); they are dropped, never routed to",
            )

    def _attend_subs(self) -> None:
        """Let every SUB process its commands, reading nothing: a connecting PUB is attached
        (and sent the subscription) only while its SUB does (libzmq #2267)."""
        for feed in self.feeds.values():
            if feed.sub is not None:
                feed.sub.getsockopt(zmq.EVENTS)

    # --- persistence -------------------------------------------------------------------------

    def _path(self, shard_id: str) -> Path:
        return state_path(self._dir, shard_id)

    def _persist(self, feed: Feed) -> None:
        mirror = feed.mirror
        if mirror.version == feed.persisted_version:
            return
        spec = feed.spec
        with feed.lock:
            version = mirror.version
            dumped = mirror.dump()
        path = self._path(spec.shard_id)
        try:
            save_mirror(
                path,
                shard_id=spec.shard_id,
                engine_generation=spec.engine_generation,
                block_size=feed.block_size,
                dumped=dumped,
            )
        except OSError as exc:
            _log.warning(
                "kv_mirror_persist_failed", shard=spec.shard_id, path=str(path), error=str(exc)
            )
            return
        feed.persisted_version = version

    def _load(self, spec: WatchSpec) -> tuple[BlockMirror, int | None]:
        """The persisted mirror of this engine process, or a fresh one (and the block size)."""
        path = self._path(spec.shard_id)
        try:
            loaded = load_mirror(
                path,
                shard_id=spec.shard_id,
                engine_generation=spec.engine_generation,
                max_blocks=self._mirror_max_blocks,
            )
        except KVError as exc:
            # A corrupt file must not take the shard down: start empty; the forward fill from
            # replay rebuilds what the engine's buffer still holds, else the view turns partial.
            _log.warning(
                "kv_mirror_state_unreadable", shard=spec.shard_id, path=str(path), error=str(exc)
            )
            self._metrics.state_errors.inc()
            loaded = None
        if loaded is None:
            return BlockMirror(max_blocks=self._mirror_max_blocks), None
        mirror, block_size = loaded
        _log.info(
            "kv_mirror_loaded",
            shard=spec.shard_id,
            version=mirror.version,
            last_seq=mirror.last_seq,
            num_blocks=mirror.num_blocks,
        )
        return mirror, block_size
