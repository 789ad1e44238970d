"""The KV-event publisher: vLLM's ZmqEventPublisher, socket for socket and frame for frame.

- PUB socket, SNDHWM = hwm. It BINDS when the endpoint contains "*" or "::"
  or starts with ipc:// or inproc://, and CONNECTS otherwise: the node agent
  binds a SUB on its own port and points each engine at it, so a restarted
  engine reconnects without the agent re-subscribing.
- Live message: [topic, seq (8 bytes big-endian), msgpack batch]; seq starts
  at 0 per process and goes up by one per batch, so a subscriber sees a
  restart as seq going backwards.
- Replay ROUTER (bound, when replay_endpoint is set) keeps the last
  buffer_steps batches; a request [identity, b"", start_seq] gets every
  buffered batch with seq >= start_seq and an end marker, in the >= 0.26
  shape (with topic) for map-shaped events and the <= 0.25 shape for arrays.

Payloads are llmgw.kv.codec's and frames llmgw.kv.frames'; this module only owns sockets. Sends never
block the engine loop (PUB drops at the high-water mark, as vLLM's does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from llmgw.eventloop import cancel_and_wait
from llmgw.kv.codec import HashForm, Shape, encode_batch
from llmgw.kv.errors import KVDecodeError
from llmgw.kv.events import BlockRemoved, BlockStored, EventBatch, KVEvent
from llmgw.kv.frames import (
    decode_replay_request,
    encode_message,
    encode_replay_end,
    encode_replay_reply,
)
from llmgw.logs import get_logger
from llmgw.simengine.config import KvEventsConfig

__all__ = ["KvEventPublisher", "endpoint_binds"]

_log = get_logger(__name__)


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard hosts and local transports bind, everything else connects."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, *, shape: Shape, hash_form: HashForm) -> None:
        self._config = config
        self._shape: Shape = shape
        self._hash_form: HashForm = hash_form
        self._topic = config.topic.encode()
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.pub_endpoint = ""
        self.replay_endpoint: str | None = None

    @property
    def last_seq(self) -> int:
        """The seq of the last batch sent; -1 before the first."""
        return self._next_seq - 1

    def start(self) -> None:
        cfg = self._config
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if endpoint_binds(cfg.endpoint):
            self._pub.bind(cfg.endpoint)
            self.pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(cfg.endpoint)
            self.pub_endpoint = cfg.endpoint
        if cfg.replay_endpoint:
            router = self._actx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(cfg.replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._router = router
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        _log.info(
            "kv_events_publishing",
            endpoint=self.pub_endpoint,
            mode="bind" if endpoint_binds(cfg.endpoint) else "connect",
            replay_endpoint=self.replay_endpoint,
            topic=cfg.topic,
            shape=self._shape,
            hash_form=self._hash_form,
        )

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Send one step's events as one batch (callers skip steps without events, as vLLM does)."""
        if self._shape == "array":
            # The positional layouts we emit (vLLM <= 0.19) end before group_idx (0.20).
            events = [_without_group(e) for e in events]
        batch = EventBatch(ts=time.time(), events=tuple(events), data_parallel_rank=0)
        payload = encode_batch(batch, shape=self._shape, hash_form=self._hash_form)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(encode_message(self._topic, seq, payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        with_topic = self._shape == "map"
        topic = self._topic if with_topic else None
        while True:
            frames = await router.recv_multipart()
            try:
                request = decode_replay_request(frames)
            except KVDecodeError as exc:
                _log.warning("kv_replay_request_invalid", error=str(exc))
                continue
            for seq, payload in list(self._buffer):
                if seq >= request.start_seq:
                    await router.send_multipart(
                        encode_replay_reply(seq, payload, topic=topic, identity=request.identity)
                    )
            await router.send_multipart(
                encode_replay_end(with_topic=with_topic, identity=request.identity)
            )

    async def close(self) -> None:
        await cancel_and_wait(self._replay_task)
        if self._router is not None:
            self._router.close(linger=0)
        self._pub.close(linger=0)
        self._actx.term()
        self._ctx.term()


def _without_group(event: KVEvent) -> KVEvent:
    if isinstance(event, BlockStored | BlockRemoved) and event.group_idx is not None:
        return dataclasses.replace(event, group_idx=None)
    return event
