"""The internal listener's error body: ``{"error": {"code", "message", "field"}}``.

``code`` and the status come from the error tree (``llmgw.errors``: ``CODES`` is the table,
``status_of`` the one mapping); this module only renders them. ``render`` answers an error of
the tree; ``error_response`` a status and code a middleware or framework hands over bare
(``code_for_status``: starlette's HTTPException carries a status alone).

What this module must not do: echo a value the client sent beyond what the
caller puts in the message (a secret may be in any field), or produce a body
that cannot be encoded (a lone surrogate in a field name must not turn a 422
into a 500).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import Response

from llmgw.errors import (
    AuthError,
    BodyTooLargeError,
    ConflictError,
    DatabaseUnavailableError,
    InternalError,
    LlmgwError,
    MalformedJsonError,
    MethodNotAllowedError,
    NotFoundError,
    SpecError,
    UnsupportedMediaTypeError,
    clip,
    status_of,
)

__all__ = ["code_for_status", "error_body", "error_response", "printable", "render"]

# The kind of error a bare status stands for, where the tree has one kind per status.
_BY_STATUS: dict[int, str] = {
    cls.status: cls.code
    for cls in (
        MalformedJsonError,
        AuthError,
        NotFoundError,
        MethodNotAllowedError,
        ConflictError,
        BodyTooLargeError,
        UnsupportedMediaTypeError,
        SpecError,
        InternalError,
        DatabaseUnavailableError,
    )
}


def code_for_status(status: int) -> str:
    """The tree's code for a bare HTTP status; 4xx/5xx outside it fall back by class."""
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return InternalError.code if status >= 500 else SpecError.code


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


def render(exc: LlmgwError, headers: Mapping[str, str] | None = None) -> Response:
    """``exc`` in the admin shape, with the status and code its type states."""
    return error_response(status_of(exc), exc.code, exc.message, exc.field, headers)
