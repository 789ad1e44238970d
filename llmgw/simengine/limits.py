"""Request-body limits: what one request may cost the simulator before it is refused.

One request must never freeze or kill the process serving everyone else's
streams. Each limit here closes a way it could (issue [hardening] item 6):

- Body size: `--max-body-bytes` (default 16 MiB), enforced by llmgw.http.bodies'
  capped reader: a declared Content-Length over the cap is refused 413 before
  a byte is read, and a body without one is refused as soon as it passes the
  cap. Measured before the cap: a 50 MB prompt held the event loop for 3.6 s.
- Nesting and NaN/Infinity: llmgw.http.bodies' bounded parser (`MAX_JSON_DEPTH`
  levels, measured on the raw bytes before anything parses them).
- Large bodies are parsed and tokenized off the event loop (`OFFLOAD_BODY_BYTES`).

This module holds the simulator's numbers and maps llmgw.http.bodies' neutral
exceptions to the engine's errors (413 BodyTooLargeError, 400 SpecError).
Must NOT read or parse bodies itself (llmgw.http.bodies does), know request shapes
(api_models.py) or generation (generation.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from llmgw.errors import LlmgwError, SpecError
from llmgw.http import bodies

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "OFFLOAD_BODY_BYTES",
    "BodyTooLargeError",
    "parse_json_body",
    "read_capped_body",
]

# 16 MiB: a max_model_len of 1M tokens as text (~4 MB) or as a JSON id list (~7 MB) fits with
# room to spare; the simulator serves text only, so no image payload needs more.
DEFAULT_MAX_BODY_BYTES: Final = 16 * 1024 * 1024
# Bodies larger than this are parsed, validated and tokenized on a worker thread: tokenizing is
# a Python loop (~70 ns per character), so a 16 MiB prompt would hold the event loop ~1 s.
# Below it the thread hop (~50 us) would cost more than the work it moves.
OFFLOAD_BODY_BYTES: Final = 64 * 1024


class BodyTooLargeError(LlmgwError):
    """The body is over --max-body-bytes: answered 413 without buffering more than the cap."""

    code = "body-too-large"


async def read_capped_body(
    receive: bodies.Receive, headers: Iterable[tuple[bytes, bytes]], cap: int
) -> bytes:
    """The whole body, or BodyTooLargeError as soon as it is known to exceed `cap` bytes
    (SpecError for a Content-Length that is not a number). A client that leaves mid-body
    raises bodies.ClientGone."""
    value = next((v for name, v in headers if name.lower() == b"content-length"), None)
    try:
        return await bodies.read_asgi(receive, cap, bodies.declared_length(value))
    except bodies.BadContentLength as exc:
        raise SpecError(str(exc), field="content-length") from None
    except bodies.BodyTooLarge as exc:
        raise BodyTooLargeError(
            f"the request body is {exc.seen} bytes, over this engine's limit of {exc.cap} bytes "
            "(--max-body-bytes); send a shorter prompt or raise the limit"
        ) from None


def parse_json_body(body: bytes) -> Any:
    """The body as JSON, refusing (SpecError, a 400) what is not JSON or nests too deeply."""
    try:
        return bodies.parse_json(body)
    except bodies.BadJson as exc:
        raise SpecError(str(exc)) from None
