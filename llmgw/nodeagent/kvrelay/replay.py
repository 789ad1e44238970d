"""Catching a feed up from its engine's replay ROUTER: filling a seq gap the live stream
revealed (``fill_gap``), and forward-filling after each (re)watch and whenever the engine went
quiet (``probe``). What cannot be replayed (no replay port, the engine's buffer moved on, a
malformed replayed batch) leaves the mirror resynced to a partial view.

It runs on the ingest thread only (ingest.py), on that thread's ZMQ context, and while it
waits for a reply it lets every SUB attach its connecting PUBs (``attend_subs``). It must NOT
read a feed's SUB, nor persist a mirror.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from llmgw.kv import (
    DecodedBatch,
    KVDecodeError,
    decode_batch,
    decode_replay_reply,
    encode_replay_request,
)
from llmgw.logs import get_logger
from llmgw.nodeagent.kvrelay.feed import Feed
from llmgw.nodeagent.kvrelay.metrics import RelayMetrics

__all__ = ["Replayer"]

# The ingest thread's logger: these events were its own before replay had a module.
_log = get_logger("llmgw.nodeagent.kvrelay.ingest")

_MAX_REPLAY_BATCHES = 200_000  # vLLM keeps 10000 by default; past this the engine is misbehaving
_REPLAY_SLICE_MS = 10  # messages queued per SUB while the thread is busy (e.g. replaying)


class Replayer:
    """Requests batches from engines' replay ROUTERs and applies them to their feeds' mirrors."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        metrics: RelayMetrics,
        *,
        on_change: Callable[[], None],
        attend_subs: Callable[[], None],
        replay_timeout_s: float,
        probe_interval_s: float,
    ) -> None:
        self._ctx = ctx
        self._metrics = metrics
        self._on_change = on_change
        self._attend_subs = attend_subs
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self._probe_interval_s = probe_interval_s

    def fill_gap(self, feed: Feed, seq: int, decoded: DecodedBatch) -> None:
        """Batch ``seq`` arrived past the mirror's expected seq: replay what lies between."""
        shard = feed.spec.shard_id
        mirror = feed.mirror
        expected = mirror.expected_seq
        replayed = self._replay(feed, expected)
        feed.learn_block_size(b.batch for _, b in replayed)
        with feed.lock:
            for rseq, rbatch in replayed:
                if mirror.apply(rseq, rbatch.batch).outcome == "gap":
                    break
            filled = mirror.apply(seq, decoded.batch).outcome != "gap"
            if not filled:
                mirror.resync(seq, decoded.batch)
        outcome = "filled" if filled else "reset"
        self._metrics.gaps.labels(shard=shard, outcome=outcome).inc()
        if not filled:
            self._metrics.resets.labels(shard=shard, reason="gap").inc()
        self._metrics.partial.labels(shard=shard).set(1 if mirror.partial else 0)
        _log.info(
            "kv_gap",
            shard=shard,
            missing_from=expected,
            missing_to=seq - 1,
            outcome=outcome,
            replayed=len(replayed),
        )

    def probe(self, feed: Feed) -> None:
        """Forward-fill from replay: after (re)watching, and whenever the engine went quiet.

        Catches batches that raced the subscription or were lost last with no later batch to
        reveal the gap; an engine whose buffer moved past our seq leaves a partial view.
        """
        now = time.monotonic()
        feed.next_probe_at = now + self._probe_interval_s
        if feed.spec.replay_port is None:
            return
        if feed.last_live_at and now - feed.last_live_at < self._probe_interval_s / 2:
            return  # live traffic reveals gaps by itself
        mirror = feed.mirror
        expected = mirror.expected_seq
        replayed = self._replay(feed, expected)
        if not replayed:
            return
        first_seq, first = replayed[0]
        feed.learn_block_size(b.batch for _, b in replayed)
        changed = False
        with feed.lock:
            before = mirror.version
            if first_seq > expected:
                mirror.resync(first_seq, first.batch)
                self._metrics.resets.labels(shard=feed.spec.shard_id, reason="gap").inc()
                self._metrics.gaps.labels(shard=feed.spec.shard_id, outcome="reset").inc()
            for rseq, rbatch in replayed:
                if mirror.apply(rseq, rbatch.batch).outcome == "gap":
                    break
            changed = mirror.version != before
        self._metrics.partial.labels(shard=feed.spec.shard_id).set(1 if mirror.partial else 0)
        self._metrics.blocks.labels(shard=feed.spec.shard_id).set(mirror.num_blocks)
        if changed:
            _log.info(
                "kv_forward_filled",
                shard=feed.spec.shard_id,
                from_seq=expected,
                replayed=len(replayed),
                partial=mirror.partial,
            )
            self._on_change()

    def _replay(self, feed: Feed, start_seq: int) -> list[tuple[int, DecodedBatch]]:
        """Batches from ``start_seq`` on, from the engine's replay ROUTER; [] if unavailable.

        A fresh DEALER per request: after a timeout, a late reply on a reused socket would be
        taken for the answer to the next request.
        """
        port = feed.spec.replay_port
        if port is None:
            return []
        shard = feed.spec.shard_id
        dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, DecodedBatch]] = []
        try:
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send_multipart(encode_replay_request(start_seq))
            while len(out) < _MAX_REPLAY_BATCHES:
                if not self._await_reply(dealer):
                    self._metrics.replay_timeouts.labels(shard=shard).inc()
                    _log.info("kv_replay_timeout", shard=shard, start_seq=start_seq)
                    return out
                reply = decode_replay_reply(dealer.recv_multipart())
                if reply.is_end:
                    break
                if reply.topic is not None and reply.topic.encode() != feed.topic:
                    raise KVDecodeError(f"replayed batch has topic {reply.topic[:60]!r}")
                out.append((reply.seq, decode_batch(reply.payload)))
        except KVDecodeError as exc:
            # What came before the bad reply is still good; the caller sees a gap after it.
            self._metrics.for_shard(shard).malformed.inc()
            _log.warning("kv_replay_malformed", shard=shard, error=str(exc))
        finally:
            dealer.close(linger=0)
        return out

    def _await_reply(self, dealer: zmq.Socket[bytes]) -> bool:
        """Wait for the DEALER in short slices, letting every SUB process its commands between
        them: a SUB left alone for the whole timeout would not attach an engine connecting
        meanwhile, and that engine's first batches would be lost (the race the ingest thread
        exists to close)."""
        deadline = time.monotonic() + self._replay_timeout_ms / 1000
        while True:
            if dealer.poll(_REPLAY_SLICE_MS):
                return True
            self._attend_subs()
            if time.monotonic() >= deadline:
                return False
