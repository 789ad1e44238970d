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
  which Python's parser accepts and which slip through every ``>= 0`` check, are refused;
- text is Unicode: a body that is not UTF-8, or whose ``\\uXXXX`` escapes leave a lone UTF-16
  surrogate (Python's parser accepts both), is refused, since every later ``.encode()`` of
  such a string raises (a 500 wherever the body is forwarded, stored or tokenized).

``parse_json`` applies all of it; ``check_json`` applies the same rules to the raw bytes
without parsing them, for a listener whose parser is another one (pydantic's).
Both cost the common body ~nothing beyond the parse: a memchr-speed pass finds too few
brackets to nest deeply, another no backslash to escape a surrogate with.

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
    "check_json",
    "declared_length",
    "json_depth_exceeds",
    "lone_surrogate",
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
# A ``\u`` escape of a UTF-16 surrogate, high (D800-DBFF) or low (DC00-DFFF).
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# What cannot leave a surrogate alone, matched left to right so that an escaped backslash
# (two backslashes) is taken whole and its second half never read as the start of an escape:
# a high surrogate's escape followed at once by a low one's (how ASCII-only clients send an
# emoji), and an escaped backslash.
_NOT_LONE: Final = re.compile(rb"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_UTF8_BOM: Final = b"\xef\xbb\xbf"
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


def _few_brackets(body: bytes, limit: int) -> bool:
    """Whether the body opens at most `limit` arrays/objects in all: too few to nest deeper.
    Found one by one (memchr per bracket, at most `limit` + 1 of them) rather than counted:
    a count reads every byte of a 16 KB prompt in ~12 us, this ~1 us for a chat body's few."""
    seen = 0
    for bracket in (b"[", b"{"):
        at = body.find(bracket)
        while at >= 0:
            seen += 1
            if seen > limit:
                return False
            at = body.find(bracket, at + 1)
    return True


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether the body nests arrays/objects deeper than `limit` (brackets in strings ignored)."""
    if _few_brackets(body, limit):
        return False  # the common case, decided without reading the body twice
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


def lone_surrogate(body: bytes) -> str | None:
    """The first ``\\uXXXX`` escape in the body that leaves a UTF-16 surrogate alone (as it is
    written, e.g. ``\\ud800``), None when there is none."""
    if b"\\" not in body or _SURROGATE_ESCAPE.search(body) is None:
        return None  # the common case: no escape at all (memchr), or none of a surrogate
    # Pairs and escaped backslashes gone, any surrogate escape left is a lone one.
    found = _SURROGATE_ESCAPE.search(_NOT_LONE.sub(b"", body))
    return None if found is None else found.group().decode("ascii")


def _not_finite(name: str) -> str:
    return f"{name} is not valid JSON; send a finite number"


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(_not_finite(name))


def _too_deep(limit: int) -> BadJson:
    return BadJson(
        f"the request body nests arrays/objects more than {limit} levels deep; flatten it"
    )


def _check_nesting_and_text(body: bytes, max_depth: int) -> None:
    if json_depth_exceeds(body, max_depth):
        raise _too_deep(max_depth)
    escape = lone_surrogate(body)
    if escape is not None:
        raise _lone_surrogate(escape)


def _lone_surrogate(escape: str) -> BadJson:
    return BadJson(
        f"the request body holds a lone UTF-16 surrogate ({escape}) that is not valid "
        "Unicode; send UTF-8 text (a surrogate escape only as half of a pair)"
    )


# One decoder for every call: json.loads with a keyword builds a new one each time.
_DECODER: Final = json.JSONDecoder(parse_constant=_refuse_constant)


_CONTAINERS: Final = (dict, list)


def nests_deeper_than(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests arrays/objects deeper than ``limit`` (what
    ``json_depth_exceeds`` decides on the bytes), one level at a time."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        keep = below.append
        # Plain loops and identity tests: a generator per container cost 3x on 240,000 small
        # objects (0.10 s against 0.037 s).
        for v in level:
            for x in v.values() if type(v) is dict else v:
                if type(x) is dict or type(x) is list:
                    keep(x)
        level = below
    return False


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The body as JSON, refusing (BadJson) what is not JSON, not UTF-8, nests too deeply,
    holds NaN/Infinity or a lone surrogate."""
    # A body of many brackets is parsed first and its depth measured on the result: the
    # bytes' check removes every string with a regex (0.24 s for a 7.4 MB chat of 240,000
    # small messages, on the gateway's loop) where the C parser takes 0.10 s and the walk
    # ~0.03 s. Parsing a deep body is safe: the C parser's own recursion guard raises
    # RecursionError, answered below as too deep.
    bracketed = not _few_brackets(body, max_depth)
    escape = lone_surrogate(body)
    if escape is not None:
        raise _lone_surrogate(escape)
    value = _decode(body, max_depth)
    if bracketed and nests_deeper_than(value, max_depth):
        raise _too_deep(max_depth)
    return value


def _decode(body: bytes, max_depth: int) -> Any:
    try:
        # Strict UTF-8 (json.loads on bytes decodes with surrogatepass, letting an encoded
        # surrogate through); a UTF-8 byte order mark is skipped, as json.loads skips it.
        text = body.decode("utf-8-sig" if body.startswith(_UTF8_BOM) else "utf-8")
    except UnicodeDecodeError as exc:
        raise BadJson(
            f"the request body is not UTF-8 ({exc.reason} at byte {exc.start}); send UTF-8 text"
        ) from None
    try:
        return _DECODER.decode(text)
    except RecursionError:
        # Nested past the interpreter's recursion limit (~1,000 levels): too deep, not a 500.
        raise _too_deep(max_depth) from None
    except ValueError as exc:
        raise BadJson(f"request body is not JSON: {exc}") from None


def check_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse (BadJson) what ``parse_json`` refuses beyond syntax, on the raw bytes and without
    parsing them: for a listener whose parser is another one. Pydantic's, for one, stops at
    200 levels (so a deep body's error path, which parsed it again with Python's parser,
    raised RecursionError) and takes NaN/Infinity into any float field."""
    _check_nesting_and_text(body, max_depth)
    if b"NaN" in body or b"Infinity" in body:
        # Outside strings, the only words JSON has are true, false and null.
        bare = _STRING_RE.sub(b"", body)
        for name in (b"NaN", b"Infinity"):
            if name in bare:
                raise BadJson(f"request body is not JSON: {_not_finite(name.decode())}")
