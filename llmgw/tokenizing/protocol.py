"""The pool <-> worker wire: one frame per message (4-byte big-endian length, then msgpack), a
request map with its ``op`` and a reply map with ``ok``; a failed reply's ``kind`` says whose
fault it was:

- "refused": the engine refuses the request too (a template's ``raise_exception``, an empty
  chat): the request goes on, the engine says why;
- "too_long": the rendered prompt is over the call's ``max_chars`` (the client's: a 400);
- "unsupported": a body this cannot tokenize (a completion whose prompt is not one string);
- "unknown": the worker does not hold that digest (yet);
- "files": the files are not a tokenizer (``TokenizerFilesError``);
- "failed": anything else the tokenizer or the template raised (a Rust panic, a
  ``ZeroDivisionError``, ``MemoryError``, a template over its step budget): the tokenizer's
  fault, counted against it.

No I/O here: the pool and the worker own the pipes.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

__all__ = ["HEADER_BYTES", "MAX_FRAME_BYTES", "decode", "encode", "frame", "frame_length"]

HEADER_BYTES: Final = 4
# A request carries at most a body (the gateway's cap is 256 MiB at most) or a set of files
# (64 MiB); a reply at most a prompt's ids.
MAX_FRAME_BYTES: Final = 320 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode(message: dict[str, Any]) -> bytes:
    """Raises ``TypeError`` / ``OverflowError`` for a value msgpack cannot carry (an integer
    past 64 bits)."""
    return _encoder.encode(message)


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload


def frame_length(header: bytes) -> int:
    n = int.from_bytes(header, "big")
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {n} bytes is over {MAX_FRAME_BYTES}")
    return n


def decode(payload: bytes) -> dict[str, Any]:
    got = _decoder.decode(payload)
    if not isinstance(got, dict):
        raise ValueError("a frame is not a map")
    return got
