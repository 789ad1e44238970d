"""The control plane's internal HTTP application: health, readiness and the admin API.

Errors leave as ``{"error": {"code", "message", "field"}}`` through one table
(``_STATUS``) from ``llmgw.errors`` types to HTTP status; database constraint
violations that slip past the API's own checks (a race, a direct SQL write)
become 409/422 naming the constraint instead of a 500. Every request is logged
once, with a request id that is also returned in ``X-Request-ID``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import structlog
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.orm.exc import StaleDataError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmgw.config import ControlPlaneSettings
from llmgw.controlplane import migrations
from llmgw.controlplane.admin_api import admin_router
from llmgw.controlplane.database import create_engine, session_factory
from llmgw.errors import (
    AuthError,
    ConfigError,
    ConflictError,
    LlmgwError,
    NotFoundError,
    PlacementError,
    SpecError,
)

__all__ = ["create_app"]

log = structlog.get_logger("llmgw.controlplane")

_STATUS: dict[type[LlmgwError], int] = {
    AuthError: 401,
    NotFoundError: 404,
    ConflictError: 409,
    SpecError: 422,
    PlacementError: 422,
    ConfigError: 500,
}

# Constraint name -> (status, field, what it means). Anything unlisted is still a 409/422.
_CONSTRAINTS: dict[str, tuple[int, str, str]] = {
    "uq_models_name": (409, "name", "a model with this name already exists"),
    "uq_profiles_name": (409, "name", "a profile with this name already exists"),
    "uq_deployments_name": (409, "name", "a deployment with this name already exists"),
    "fk_profiles_model_id_models": (409, "model", "the model is still used by profiles"),
    "fk_deployments_profile_id_profiles": (409, "profile", "the profile is used by a deployment"),
    "fk_deployments_model_id_models": (409, "model", "the model is used by a deployment"),
}


def _error(status: int, code: str, message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"code": code, "message": message, "field": field}},
        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None,
    )


def _status_of(exc: LlmgwError) -> int:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500


async def _on_llmgw_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LlmgwError)
    return _error(_status_of(exc), exc.code, exc.message, exc.field)


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return _error(
            400, "malformed-json", f"the body is not valid JSON: {ctx.get('error', first['msg'])}"
        )
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {field!r}; check its spelling against the API's schema (GET /openapi.json)"
    else:
        message = f"{field or 'body'}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return _error(422, "spec-invalid", message, field)


async def _on_integrity_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, IntegrityError)
    diag = getattr(exc.orig, "diag", None)
    name = getattr(diag, "constraint_name", None) or ""
    sqlstate = getattr(exc.orig, "sqlstate", None) or ""
    if name in _CONSTRAINTS:
        status, field, meaning = _CONSTRAINTS[name]
        return _error(status, "conflict" if status == 409 else "spec-invalid", meaning, field)
    if sqlstate == "23514":  # check_violation
        return _error(422, "spec-invalid", f"the database refused the value (rule {name})", None)
    return _error(
        409, "conflict", f"the change conflicts with stored state (constraint {name or sqlstate})"
    )


async def _on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http-error")
    return _error(exc.status_code, code, str(exc.detail))


async def _on_data_error(_request: Request, exc: Exception) -> JSONResponse:
    # SQLSTATE class 22: a value the column cannot hold that slipped past the schema's bounds.
    detail = str(getattr(exc, "orig", exc)).splitlines()[0]
    return _error(422, "spec-invalid", f"the database cannot store a value: {detail}")


async def _on_stale(_request: Request, _exc: Exception) -> JSONResponse:
    return _error(
        409,
        "conflict",
        "someone else changed this object while your update was applied; GET it again, "
        "reapply your change and retry",
        "version",
    )


async def _on_db_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    log.error("database_error", error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return _error(503, "database-unavailable", "the state store is unreachable; retry shortly")


def create_app(settings: ControlPlaneSettings) -> FastAPI:
    """Build the internal app. The database URL and admin token must be set."""
    if not settings.database_url:
        raise ConfigError(
            "controlplane.database_url is empty: set LLMGW_CONTROLPLANE__DATABASE_URL or "
            "[controlplane] database_url, or run `llmgw up`, which brings its own Postgres",
            field="controlplane.database_url",
        )
    if not settings.admin_token:
        raise ConfigError(
            "controlplane.admin_token is empty: set LLMGW_CONTROLPLANE__ADMIN_TOKEN (16+ characters; "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))')",
            field="controlplane.admin_token",
        )
    engine = create_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        connect_timeout_s=settings.db_connect_timeout_s,
    )
    head = migrations.head_revision()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.dispose()

    app = FastAPI(
        title="llmgw control plane",
        version="v1",
        description="Admin API of llmgw: models, profiles, deployments.",
        lifespan=lifespan,
    )
    app.state.admin_token = settings.admin_token
    app.state.sessions = session_factory(engine)
    app.add_exception_handler(LlmgwError, _on_llmgw_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(IntegrityError, _on_integrity_error)
    app.add_exception_handler(DataError, _on_data_error)
    app.add_exception_handler(StaleDataError, _on_stale)
    # What is left of DBAPIError (OperationalError, InterfaceError): Postgres is unreachable.
    app.add_exception_handler(DBAPIError, _on_db_unavailable)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)

    @app.middleware("http")
    async def request_log(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        rid = request.headers.get("x-request-id") or secrets.token_hex(8)
        request.state.request_id = rid
        structlog.contextvars.bind_contextvars(request_id=rid)
        start = time.perf_counter()
        try:
            response = await call_next(request)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")
        response.headers["X-Request-ID"] = rid
        log.info(
            "http_request",
            request_id=rid,
            method=request.method,
            path=request.url.path,
            status=response.status_code,
            duration_ms=round((time.perf_counter() - start) * 1000, 2),
        )
        return response

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"description": "not ready"}})
    async def readyz() -> JSONResponse:
        """Readiness: the database answers and its schema is at the migrations' head."""
        checks: dict[str, Any] = {"database": "ok", "schema": "ok"}
        ready = True
        try:
            async with engine.connect() as conn:
                current = (
                    await conn.execute(text("SELECT version_num FROM alembic_version"))
                ).scalar_one_or_none()
            if current != head:
                ready = False
                checks["schema"] = f"at {current}, want {head}: run `llmgw db upgrade`"
        except Exception as exc:  # any failure to reach or read the database means not ready
            ready = False
            checks["database"] = f"unreachable: {type(exc).__name__}"
        return JSONResponse(
            status_code=200 if ready else 503,
            content={"status": "ready" if ready else "not-ready", "checks": checks},
        )

    app.include_router(admin_router)
    return app
