"""The ZMQ frames of vLLM's KV event publisher: live messages and the replay protocol.

Holds encoders/decoders for a live PUB message ``[topic, seq8, payload]``, a replay request
``[b"", seq8]`` (as a DEALER sends it; a ROUTER sees the identity first), and replay replies in
both shapes: ``[b"", seq8, payload]`` up to vLLM 0.25 and ``[b"", topic, seq8, payload]`` since
0.26, each closed by an end marker with seq ``b"\\xff" * 8`` and an empty payload
(vLLM's ``ZmqEventPublisher``). Payloads pass through untouched: parsing them is
``llmgw.kv.codec``'s job.

Decoders raise ``KVDecodeError`` and nothing else: frames come from the network. This module
must NOT open sockets or import zmq/asyncio: the agent's listener and the simulator's publisher
hand frames in and out.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.kv.errors import KVDecodeError, KVError

__all__ = [
    "END_SEQ",
    "KVMessage",
    "ReplayReply",
    "ReplayRequest",
    "decode_message",
    "decode_replay_reply",
    "decode_replay_request",
    "encode_message",
    "encode_replay_end",
    "encode_replay_reply",
    "encode_replay_request",
]

# The seq of a replay end marker (b"\xff" * 8).
END_SEQ = (1 << 64) - 1
_SEQ = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class KVMessage:
    """One live PUB message: the engine's topic, its batch sequence number and the payload."""

    topic: str
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """``start_seq`` asked of a replay ROUTER; ``identity`` is the DEALER's, when frames had it."""

    start_seq: int
    identity: bytes | None = None


@dataclass(frozen=True, slots=True)
class ReplayReply:
    """One replayed batch, or the end marker (``is_end``, seq ``END_SEQ``, empty payload).

    ``topic`` is None for the <= 0.25 shape, which has no topic frame.
    """

    seq: int
    payload: bytes
    topic: str | None
    is_end: bool


def _seq_bytes(seq: int) -> bytes:
    if type(seq) is not int or not 0 <= seq <= END_SEQ:
        raise KVError(f"seq {seq!r} does not fit 8 unsigned bytes", field="seq")
    return _SEQ.pack(seq)


def _topic_bytes(topic: str | bytes) -> bytes:
    return topic if isinstance(topic, bytes) else topic.encode("utf-8")


def _frame(frames: Sequence[object], i: int, what: str) -> bytes:
    value = frames[i]
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise KVDecodeError(f"{what}: frame {i} is {type(value).__name__}, expected bytes")


def _seq_of(frame: bytes, what: str) -> int:
    if len(frame) != 8:
        raise KVDecodeError(
            f"{what}: sequence frame has {len(frame)} bytes, expected 8 (big-endian)"
        )
    return int(_SEQ.unpack(frame)[0])


def _topic_of(frame: bytes, what: str) -> str:
    try:
        return frame.decode("utf-8")
    except UnicodeDecodeError:
        raise KVDecodeError(f"{what}: topic {frame[:40]!r} is not UTF-8") from None


def encode_message(topic: str | bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three frames vLLM's PUB socket sends for one batch."""
    return [_topic_bytes(topic), _seq_bytes(seq), bytes(payload)]


def decode_message(frames: Sequence[bytes]) -> KVMessage:
    """Split a live message into topic, sequence number and payload (payload not parsed)."""
    what = "KV event message"
    if len(frames) != 3:
        raise KVDecodeError(f"{what} has {len(frames)} frames, expected [topic, seq, payload]")
    return KVMessage(
        topic=_topic_of(_frame(frames, 0, what), what),
        seq=_seq_of(_frame(frames, 1, what), what),
        payload=_frame(frames, 2, what),
    )


def encode_replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to a replay ROUTER: ``[b"", seq8]`` (a REQ client gets one reply only)."""
    return [b"", _seq_bytes(start_seq)]


def decode_replay_request(frames: Sequence[bytes]) -> ReplayRequest:
    """A replay request as a ROUTER receives it (``[identity, b"", seq8]``) or without identity."""
    what = "KV replay request"
    if len(frames) == 3:
        identity: bytes | None = _frame(frames, 0, what)
        rest = 1
    elif len(frames) == 2:
        identity, rest = None, 0
    else:
        raise KVDecodeError(f"{what} has {len(frames)} frames, expected [identity,] b'', seq8")
    if _frame(frames, rest, what) != b"":
        raise KVDecodeError(f"{what}: delimiter frame is not empty")
    return ReplayRequest(_seq_of(_frame(frames, rest + 1, what), what), identity)


def encode_replay_reply(
    seq: int, payload: bytes, *, topic: str | bytes | None, identity: bytes | None = None
) -> list[bytes]:
    """One replayed batch: ``topic=None`` gives the <= 0.25 shape, a topic the >= 0.26 one.

    ``identity`` (the requesting DEALER's) is prepended for sending from a ROUTER socket.
    """
    head = [] if identity is None else [identity]
    if topic is None:
        return [*head, b"", _seq_bytes(seq), bytes(payload)]
    return [*head, b"", _topic_bytes(topic), _seq_bytes(seq), bytes(payload)]


def encode_replay_end(*, with_topic: bool, identity: bytes | None = None) -> list[bytes]:
    """The end marker closing a replay: 3 frames up to 0.25, 4 (empty topic) since 0.26."""
    head = [] if identity is None else [identity]
    if with_topic:
        return [*head, b"", b"", _SEQ.pack(END_SEQ), b""]
    return [*head, b"", _SEQ.pack(END_SEQ), b""]


def decode_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """A replay reply as a DEALER receives it, in either shape, end marker included."""
    what = "KV replay reply"
    if len(frames) == 3:
        topic: str | None = None
        seq_at = 1
    elif len(frames) == 4:
        topic = _topic_of(_frame(frames, 1, what), what)
        seq_at = 2
    else:
        raise KVDecodeError(
            f"{what} has {len(frames)} frames, expected b'', [topic,] seq8, payload"
        )
    if _frame(frames, 0, what) != b"":
        raise KVDecodeError(f"{what}: delimiter frame is not empty")
    seq = _seq_of(_frame(frames, seq_at, what), what)
    payload = _frame(frames, seq_at + 1, what)
    return ReplayReply(seq=seq, payload=payload, topic=topic, is_end=seq == END_SEQ and not payload)
