"""The public listener's app: the OpenAI API surface, and nothing of the control plane's.

Until the gateway lands it serves ``/healthz`` and ``GET /v1/models`` (an
empty list: no model is served yet, which is what the gateway will answer
with nothing deployed) and refuses every other path with a 404 in OpenAI's
error shape, ``{"error": {"message", "type", "param", "code"}}``, so the
official ``openai`` client raises its ``NotFoundError`` with a readable
message.

What it must not do: mount anything of the admin API, the agent API, metrics or
the docs. Those live on the internal listener only (design §1): the admin token
can set engine argv on every node, so its API must not answer on an address
published to clients.
"""

from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from llmgw.controlplane.http.errors import printable
from llmgw.controlplane.http.request_log import RequestLog

__all__ = ["create_public_app", "openai_error_body"]

_NO_MODEL = (
    "no model is served yet: the OpenAI gateway of this control plane is not built yet, so "
    "{method} {path} has nothing to answer with"
)


def openai_error_body(
    message: str, *, type_: str, code: str | None, param: str | None = None
) -> bytes:
    content = {
        "error": {"message": printable(message), "type": type_, "param": param, "code": code}
    }
    return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _openai_error(
    status: int,
    message: str,
    *,
    type_: str,
    code: str | None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        openai_error_body(message, type_=type_, code=code),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


async def _healthz(_request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _models(_request: Request) -> Response:
    return JSONResponse({"object": "list", "data": []})


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return _openai_error(
            405,
            f"{request.method} is not allowed on {request.url.path}",
            type_="invalid_request_error",
            code="method_not_allowed",
            headers=dict(exc.headers or {}),
        )
    if request.url.path.startswith("/v1/"):
        return _openai_error(
            404,
            _NO_MODEL.format(method=request.method, path=request.url.path),
            type_="invalid_request_error",
            code="model_not_found",
        )
    return _openai_error(
        exc.status_code,
        f"no such path: {request.method} {request.url.path} (this listener serves the OpenAI "
        "API under /v1)",
        type_="invalid_request_error",
        code="unknown_url",
    )


def _internal_error(request_id: str) -> bytes:
    return openai_error_body(
        f"internal error; report request id {request_id}", type_="server_error", code=None
    )


def create_public_app() -> ASGIApp:
    app = Starlette(
        routes=[
            Route("/healthz", _healthz, methods=["GET"]),
            Route("/v1/models", _models, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _on_http_error},
    )
    return RequestLog(app, listener="public", internal_error=_internal_error)
