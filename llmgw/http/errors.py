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
    CODES,
    InternalError,
    LlmgwError,
    SpecError,
    TooManyRequestsError,
    clip,
    retry_after,
    status_of,
)

__all__ = ["code_for_status", "error_body", "error_response", "printable", "render"]

# The kind of error a bare status stands for, read off the tree's table: where two codes share
# a status the one ``CODES`` lists first ("spec-invalid" for 422, "internal" for 500).
# (Read backwards, so the first listed is the one left.)
_BY_STATUS: dict[int, str] = {status: code for code, status in reversed(list(CODES.items()))}


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
    """``exc`` in the admin shape, with the status and code its type states (and a 429's
    ``Retry-After``)."""
    if isinstance(exc, TooManyRequestsError):
        headers = {"Retry-After": retry_after(exc.retry_after_s), **(headers or {})}
    return error_response(status_of(exc), exc.code, exc.message, exc.field, headers)
