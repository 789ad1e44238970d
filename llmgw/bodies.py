"""Request bodies read off the network: one capped reader and one bounded JSON parser for every
listener (the gateway, the agent API, the admin API's guard, the shard proxy, the simulator).

Each listener answers in its own error shape (OpenAI's, the agent protocol's, the admin API's,
the engine's), so this module raises neutral exceptions and the caller maps them:
``BodyTooLarge`` (413), ``BadContentLength`` (400), ``ClientGone`` (nothing to answer),
``BadJson`` (400). What it guarantees to all of them alike:

- a declared Content-Length over the cap is refused before a byte is read, and one that is
  not a plain decimal number is refused, never treated as absent;
- a body without one is counted as it streams in and refused as soon as it passes the cap,
  so no more than the cap is ever buffered;
- JSON nesting is bounded (``MAX_JSON_DEPTH``) on the raw bytes before anything parses them:
  a 100k-deep body made Python's parser raise RecursionError (a 500), and NaN/Infinity,
  which Python's parser accepts and which slip through every ``>= 0`` check, are refused.

What it must not do: know any request's shape, or format an HTTP answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, Awaitable, Callable, MutableMapping
from typing import Any, Final, NoReturn

__all__ = [
    "MAX_JSON_DEPTH",
    "BadContentLength",
    "BadJson",
    "BodyTooLarge",
    "ClientGone",
    "declared_length",
    "json_depth_exceeds",
    "parse_json",
    "read_asgi",
    "read_capped",
]

# Deep enough for any tool JSON schema seen in practice (they nest ~10 levels), far below the
# ~1000 frames at which Python's parser and json.dumps raise RecursionError.
MAX_JSON_DEPTH: Final = 64
# 2**63 has 19 digits: anything longer is no length a server could honour.
_MAX_LENGTH_DIGITS: Final = 19

# A JSON string, unrolled so a long string is one C-speed match rather than a per-char loop.
_STRING_RE: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")
# Objects and arrays nest alike: one bracket kind lets one replace() peel exactly one level.
_ONE_KIND: Final = bytes.maketrans(b"{}", b"[]")


class BodyTooLarge(Exception):
    """The body is (or declares itself) over ``cap`` bytes; ``seen`` says how we know."""

    def __init__(self, cap: int, seen: str) -> None:
        super().__init__(f"the request body is {seen} bytes, over the limit of {cap} bytes")
        self.cap = cap
        self.seen = seen


class BadContentLength(Exception):
    """The Content-Length header is not a plain decimal number."""

    def __init__(self, value: str) -> None:
        super().__init__(f"Content-Length {value[:40]!r} is not a number")
        self.value = value


class ClientGone(Exception):
    """The client disconnected before its body was complete: there is no one to answer."""


class BadJson(Exception):
    """The body is not JSON this server accepts; the message says why (safe to show)."""


def declared_length(value: bytes | str | None) -> int | None:
    """The Content-Length header's value as a number, None without one (BadContentLength)."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > _MAX_LENGTH_DIGITS:
        raise BadContentLength(text)
    return int(text)


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


async def read_asgi(receive: Receive, cap: int, declared: int | None = None) -> bytes:
    """An ASGI request's whole body, or BodyTooLarge as soon as it is known to exceed ``cap``
    bytes; ClientGone when the client disconnects first.

    ``declared`` is the request's Content-Length (``declared_length``), checked first so a
    body announced too large costs nothing. A plain loop over ``receive`` rather than
    ``read_capped`` over an async generator: this is every gateway request's first await, and
    the generator (asyncio tracks each one) and a bytearray copy cost ~3 us a request more."""
    if declared is not None and declared > cap:
        raise BodyTooLarge(cap, str(declared))
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        part: bytes = message.get("body", b"")
        size += len(part)
        if size > cap:
            raise BodyTooLarge(cap, f"more than {cap}")
        chunks.append(part)
        if not message.get("more_body", False):
            # One chunk, the usual case, is returned as it is: join copies only several.
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_capped(chunks: AsyncIterable[bytes], cap: int, declared: int | None = None) -> bytes:
    """The whole body of a stream of chunks (aiohttp's, Starlette's), or BodyTooLarge as soon
    as it is known to exceed ``cap`` bytes; ``declared`` as for ``read_asgi``."""
    if declared is not None and declared > cap:
        raise BodyTooLarge(cap, str(declared))
    parts: list[bytes] = []
    size = 0
    async for part in chunks:
        size += len(part)
        if size > cap:
            raise BodyTooLarge(cap, f"more than {cap}")
        parts.append(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


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


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON; send a finite number")


def _too_deep(limit: int) -> BadJson:
    return BadJson(
        f"the request body nests arrays/objects more than {limit} levels deep; flatten it"
    )


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body as JSON, refusing (BadJson) what is not JSON or nests too deeply."""
    if json_depth_exceeds(body, max_depth):
        raise _too_deep(max_depth)
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        # Unreachable past the depth check; kept so a parser change can never make this a 500.
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadJson(f"request body is not JSON: {exc}") from None
