"""Anthropic's error shape, for the routes Anthropic's clients speak (``/v1/messages``,
``/v1/messages/count_tokens``): the gateway's errors rendered so the ``anthropic`` SDK raises
its own exception classes with the gateway's message.

    {"type": "error", "error": {"type": "<error type>", "message": "..."}}

The error type is Anthropic's for the HTTP status (its SDK picks the exception class by
status, and clients branch on the type); the gateway's own ``code`` (``rate_limit_exceeded``,
``model_not_found``, ...) has no field in this shape, and the message already names the cause
and the fix:

    status  type                     status  type
    400     invalid_request_error    413     request_too_large
    401     authentication_error     429     rate_limit_error
    402     billing_error            500     api_error
    403     permission_error         502     api_error
    404     not_found_error          503     overloaded_error
    405     invalid_request_error    504     timeout_error
    409     invalid_request_error    529     overloaded_error

Any other 4xx is an ``invalid_request_error``, any other 5xx an ``api_error``. A stream that
fails after its headers went out ends with the same body as an ``error`` event, the way
Anthropic's API (and vLLM's converter) ends one: ``event: error`` then the data line.

What it must NOT do: echo a secret. The message is the gateway error's own, built by its
raiser from names and numbers (``errors``); it is written with JSON's ASCII escapes, so even a
lone surrogate in a quoted name is a valid body, never a crash.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final, Protocol

__all__ = [
    "AnthropicError",
    "anthropic_error_body",
    "anthropic_error_type",
    "anthropic_sse_error",
    "body_of",
]

_TYPES: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class AnthropicError(Protocol):
    """What is read of a gateway error (``errors.GatewayError`` is one)."""

    @property
    def status(self) -> int: ...
    @property
    def message(self) -> str: ...


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    found = _TYPES.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> bytes:
    content = {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
    return json.dumps(content, separators=(",", ":")).encode("ascii")


def body_of(error: AnthropicError) -> bytes:
    """A gateway error's body in Anthropic's shape (its headers, ``Retry-After`` among them,
    are the error's own: ``GatewayError.headers``)."""
    return anthropic_error_body(error.status, error.message)


def anthropic_sse_error(status: int, message: str) -> bytes:
    """The event a Messages stream ends with when it fails after its headers went out: the
    client's SDK raises it, never returns a silently truncated message."""
    return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"
