"""Request-body limits: what one request may cost the simulator before it is refused.

One request must never freeze or kill the process serving everyone else's
streams. Each limit here closes a way it could (issue [hardening] item 6):

- Body size: `--max-body-bytes` (default 16 MiB). A declared Content-Length
  over the cap is refused 413 before a byte is read; a body without one is
  counted while it streams in and refused as soon as it passes the cap, so
  no more than the cap is ever buffered. Measured before the cap: a 50 MB
  prompt held the event loop for 3.6 s.
- Nesting: at most `MAX_JSON_DEPTH` levels. A 100k-deep body made the JSON
  parser raise RecursionError (a 500); the depth is measured on the raw
  bytes, at C speed, before anything parses them.
- Non-standard JSON constants (NaN, Infinity), which Python's parser accepts
  and which would slip through every `>= 0` check.

Must NOT know request shapes (api_models.py) or generation (generation.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Final, NoReturn

from llmgw.errors import LlmgwError, SpecError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "OFFLOAD_BODY_BYTES",
    "BodyTooLargeError",
    "asgi_body_chunks",
    "json_depth_exceeds",
    "parse_json_body",
    "read_capped_body",
]

# 16 MiB: a max_model_len of 1M tokens as text (~4 MB) or as a JSON id list (~7 MB) fits with
# room to spare; the simulator serves text only, so no image payload needs more.
DEFAULT_MAX_BODY_BYTES: Final = 16 * 1024 * 1024
# Deep enough for any tool JSON schema seen in practice (they nest ~10 levels), far below the
# ~1000 frames at which Python's parser and json.dumps raise RecursionError.
MAX_JSON_DEPTH: Final = 64
# Bodies larger than this are parsed, validated and tokenized on a worker thread: tokenizing is
# a Python loop (~70 ns per character), so a 16 MiB prompt would hold the event loop ~1 s.
# Below it the thread hop (~50 us) would cost more than the work it moves.
OFFLOAD_BODY_BYTES: Final = 64 * 1024

# A JSON string, unrolled so a long string is one C-speed match rather than a per-char loop.
_STRING_RE: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")
# Objects and arrays nest alike: one bracket kind lets one replace() peel exactly one level.
_ONE_KIND: Final = bytes.maketrans(b"{}", b"[]")


class BodyTooLargeError(LlmgwError):
    """The body is over --max-body-bytes: answered 413 without buffering more than the cap."""

    code = "body-too-large"


def _too_large(cap: int, seen: str) -> NoReturn:
    raise BodyTooLargeError(
        f"the request body is {seen} bytes, over this engine's limit of {cap} bytes "
        "(--max-body-bytes); send a shorter prompt or raise the limit"
    )


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


async def asgi_body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The body chunks of an ASGI request, as they arrive."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        body = message.get("body", b"")
        if body:
            yield body
        if not message.get("more_body", False):
            return


async def read_capped_body(
    chunks: AsyncIterator[bytes], headers: Iterable[tuple[bytes, bytes]], cap: int
) -> bytes:
    """The whole body, or BodyTooLargeError as soon as it is known to exceed `cap` bytes."""
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise SpecError(
                    f"Content-Length {value[:40]!r} is not a number", field="content-length"
                ) from None
            if declared > cap:
                _too_large(cap, str(declared))
            break
    buffer = bytearray()
    async for chunk in chunks:
        buffer += chunk
        if len(buffer) > cap:
            _too_large(cap, f"more than {cap}")
    return bytes(buffer)


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON; send a finite number")


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether the body nests arrays/objects deeper than `limit` (brackets in strings ignored)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # the common case: too few brackets to nest that deep, decided in ~1 us
    brackets = _STRING_RE.sub(b"", body).translate(_ONE_KIND, _NOT_BRACKETS)
    # Each round peels the innermost level everywhere at once (a C-speed replace), so deciding
    # costs at most `limit` passes over the brackets, whatever their shape.
    for _ in range(limit):
        peeled = brackets.replace(b"[]", b"")
        if not peeled or peeled == brackets:
            # Empty: balanced within the limit. Unchanged: not balanced JSON; the parser says why.
            return False
        brackets = peeled
    return True


def parse_json_body(body: bytes) -> Any:
    """The body as JSON, refusing (SpecError, a 400) what is not JSON or nests too deeply."""
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise SpecError(
            f"the request body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep; "
            "flatten it"
        )
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        # Unreachable past the depth check; kept so a parser change can never make this a 500.
        raise SpecError(
            f"the request body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep; "
            "flatten it"
        ) from None
    except ValueError as exc:
        raise SpecError(f"request body is not JSON: {exc}") from None
