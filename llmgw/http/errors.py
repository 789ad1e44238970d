"""The internal listener's error body and its table of stable error codes.

Every error leaves as ``{"error": {"code", "message", "field"}}``. ``code`` is
the machine-readable part clients branch on, one per kind of error, whatever
layer produced it (a middleware, FastAPI's parser, a route, the database):

    code                    status  meaning
    malformed-json          400     the body is not JSON (or not UTF-8)
    unauthorized            401     the bearer token is missing or wrong
    not-found               404     no such object, or no such path
    method-not-allowed      405     the path exists; the ``Allow`` header lists its methods
    conflict                409     a name is taken, an object is in use, a version is stale
    body-too-large          413     the body is larger than the listener's cap
    unsupported-media-type  415     the body is not sent as ``Content-Type: application/json``
    spec-invalid            422     a field breaks a rule; ``field`` names it
    placement-failed        422     no node can take a replica
    internal                500     a bug: the message carries the request id to report
    config-invalid          500     the server's own settings cannot work
    database-unavailable    503     the state store is unreachable; retry

What this module must not do: echo a value the client sent beyond what the
caller puts in the message (a secret may be in any field), or produce a body
that cannot be encoded (a lone surrogate in a field name must not turn a 422
into a 500).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import Response

from llmgw.errors import clip

__all__ = ["ERROR_CODES", "code_for_status", "error_body", "error_response", "printable"]

ERROR_CODES: dict[str, int] = {
    "malformed-json": 400,
    "unauthorized": 401,
    "not-found": 404,
    "method-not-allowed": 405,
    "conflict": 409,
    "body-too-large": 413,
    "unsupported-media-type": 415,
    "spec-invalid": 422,
    "placement-failed": 422,
    "internal": 500,
    "config-invalid": 500,
    "database-unavailable": 503,
}

# For errors raised by the framework as a bare status (starlette's HTTPException).
_BY_STATUS: dict[int, str] = {
    400: "malformed-json",
    401: "unauthorized",
    404: "not-found",
    405: "method-not-allowed",
    409: "conflict",
    413: "body-too-large",
    415: "unsupported-media-type",
    422: "spec-invalid",
    500: "internal",
    503: "database-unavailable",
}


def code_for_status(status: int) -> str:
    """The table's code for a bare HTTP status; 4xx/5xx outside the table fall back by class."""
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return "internal" if status >= 500 else "spec-invalid"


def printable(text: str) -> str:
    """``text`` made UTF-8 encodable: a lone surrogate becomes ``\\ud800``, not a crash."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(code: str, message: str, field: str | None = None) -> bytes:
    content = {
        "error": {
            "code": code,
            "message": printable(message),
            # A field's name can be what the client sent (an unknown key): never echoed whole.
            "field": None if field is None else printable(clip(field)),
        }
    }
    return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def error_response(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    merged = dict(headers or {})
    if status == 401:
        merged.setdefault("WWW-Authenticate", "Bearer")
    return Response(
        content=error_body(code, message, field),
        status_code=status,
        headers=merged,
        media_type="application/json",
    )
