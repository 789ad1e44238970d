"""The control plane's internal HTTP application: health, readiness, docs and the admin API.

Errors leave as ``{"error": {"code", "message", "field"}}`` with a code from
the table in ``llmgw.http.errors``; ``_STATUS`` maps
``llmgw.errors`` types to HTTP status. Database constraint violations that
slip past the API's own checks (a race, a direct SQL write) become 409/422
naming the constraint instead of a 500.

Outermost first, every request passes ``RequestLog`` (request id, access line,
a 500 for anything unhandled), ``AdminAuth`` (the token, from the headers,
before any body is read) and ``BodyGuard`` (JSON only, at most
``controlplane.admin_max_body_bytes``). ``/docs`` is served from assets
shipped in a package (``fastapi_offline``), so it works with no internet.

What it must not do: serve anything meant for clients of the OpenAI API; this
app is mounted on the internal listener only (``llmgw.serve.servers``).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.orm.exc import StaleDataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from llmgw.config import ControlPlaneSettings, ReconcileSettings
from llmgw.controlplane.admin.api import admin_router
from llmgw.controlplane.agentapi.endpoints import install_agent_api
from llmgw.controlplane.console import install_console
from llmgw.controlplane.instances import InstanceIdentity, new_instance_id
from llmgw.controlplane.reconcile.loop import ReconcileMetrics, Reconciler
from llmgw.embedded_postgres import libpq_url
from llmgw.errors import (
    AuthError,
    ConfigError,
    ConflictError,
    LlmgwError,
    NotFoundError,
    PlacementError,
    SpecError,
    clip,
)
from llmgw.http.admin_auth import AdminAuth
from llmgw.http.body_guard import BodyGuard
from llmgw.http.errors import code_for_status, error_body, error_response
from llmgw.http.request_log import RequestLog
from llmgw.kv.shard_views import ShardViews
from llmgw.planner.snapshot import PlanSettings
from llmgw.store import migrations
from llmgw.store.database import create_engine, session_factory

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
    "pk_gpu_classes": (409, "name", "a GPU class with this name already exists"),
    "fk_profiles_model_id_models": (409, "model", "the model is still used by profiles"),
    "fk_deployments_profile_id_profiles": (409, "profile", "the profile is used by a deployment"),
    "fk_deployments_model_id_models": (409, "model", "the model is used by a deployment"),
}


def _error(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return error_response(status, code, message, field, headers)


def _status_of(exc: LlmgwError) -> int:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500


async def _on_llmgw_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LlmgwError)
    return _error(_status_of(exc), exc.code, exc.message, exc.field)


async def _on_validation_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request"}
    # Where the value came from is not part of its name: "limit", not "query.limit".
    loc = [str(p) for p in first.get("loc", ())][1:] if first.get("loc") else []
    field = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return _error(
            400, "malformed-json", f"the body is not valid JSON: {ctx.get('error', first['msg'])}"
        )
    if first.get("type") == "string_unicode":
        # JSON's "\ud800" escape parses, but the string cannot be stored (nor printed as UTF-8).
        message = (
            f"{clip(field or 'body')}: must be valid Unicode; it holds a lone surrogate (a \\ud800-"
            "\\udfff escape without its pair): send the character itself or its full pair"
        )
    elif first.get("type") == "extra_forbidden":
        message = (
            f"unknown field {clip(field or '')!r}; check its spelling against the API's schema "
            "(GET /openapi.json)"
        )
    else:
        message = f"{clip(field or 'body')}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return _error(422, "spec-invalid", message, field)


async def _on_integrity_error(_request: Request, exc: Exception) -> Response:
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


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path. Probed through the routes' public
    ``matches``: the router's own 405 names only the first partially matching route's."""
    allowed = [
        method
        for method in _METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL
            for route in request.app.router.routes
        )
    ]
    return ", ".join(allowed)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    message = str(exc.detail)
    if exc.status_code == 405:
        headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
        message = (
            f"{request.method} is not allowed on {clip(request.url.path)}; allowed: "
            f"{headers['Allow']}"
        )
    elif exc.status_code == 404:
        message = (
            f"no such path: {clip(request.method)} {clip(request.url.path)} (the API is under "
            "/admin/v1; see /docs)"
        )
    return _error(exc.status_code, code_for_status(exc.status_code), message, None, headers)


async def _on_data_error(_request: Request, exc: Exception) -> Response:
    # SQLSTATE class 22: a value the column cannot hold that slipped past the schema's bounds.
    # Postgres' own message can quote the value (a secret reference among them): name the
    # column and the SQLSTATE only.
    orig = getattr(exc, "orig", None)
    column = getattr(getattr(orig, "diag", None), "column_name", None)
    sqlstate = getattr(orig, "sqlstate", None) or "22000"
    return _error(
        422,
        "spec-invalid",
        f"the database cannot store a value (SQLSTATE {sqlstate}); check the field's bounds "
        "in GET /openapi.json",
        column,
    )


async def _on_stale(_request: Request, _exc: Exception) -> Response:
    return _error(
        409,
        "conflict",
        "someone else changed this object while your update was applied; GET it again, "
        "reapply your change and retry",
        "version",
    )


# Deadlock and serialization failure: Postgres chose this transaction to abort so a concurrent
# one could finish. Nothing was written; the same request succeeds when sent again.
_RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})


async def _on_db_unavailable(_request: Request, exc: Exception) -> Response:
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if sqlstate in _RETRYABLE_SQLSTATES:
        log.warning("database_conflict", sqlstate=sqlstate)
        return _error(
            409,
            "conflict",
            "the change raced with another writer (the reconciler, another admin) and was "
            "rolled back; nothing was written: send it again",
        )
    log.error("database_error", error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return _error(503, "database-unavailable", "the state store is unreachable; retry shortly")


def _internal_error(request_id: str) -> bytes:
    return error_body(
        "internal", f"internal error; report request id {request_id} with the server's log"
    )


def create_app(
    settings: ControlPlaneSettings,
    *,
    instance_id: str | None = None,
    kv_intake: ShardViews | None = None,
) -> FastAPI:
    """Build the internal app. The database URL and admin token must be set.

    Its lifespan runs the reconcile loop (``controlplane.reconcile.enabled``), which
    passes only while this process holds the leader lock. ``kv_intake`` holds this process's
    prefix index, fed by agents' KV deltas; pass the one the gateway's router reads.
    """
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

    sessions = session_factory(engine)
    metrics = CollectorRegistry()
    instance = InstanceIdentity(instance_id or new_instance_id(), _advertise_url(settings))
    reconciler = (
        Reconciler(
            sessions=sessions,
            libpq_url=libpq_url(settings.database_url),
            instance_id=instance.id,
            plan_settings=_plan_settings(settings.reconcile),
            tick_s=settings.reconcile.tick_s,
            metrics=ReconcileMetrics.create(metrics),
        )
        if settings.reconcile.enabled
        else None
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        background = (
            [asyncio.create_task(reconciler.run(stop), name="reconcile")] if reconciler else []
        )
        # The console's routing charts: this process's gateway sampled into a ring.
        background.append(asyncio.create_task(console.sampler.run(stop), name="console-sampler"))
        try:
            yield
        finally:
            # Leadership is released on the way out, so a standby takes over at once (SIGTERM).
            stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            await console.calls.aclose()
            await engine.dispose()

    app = FastAPIOffline(
        title="llmgw control plane",
        version="v1",
        description="Admin API of llmgw: models, profiles, deployments.",
        lifespan=lifespan,
    )
    app.state.admin_token = settings.admin_token
    app.state.sessions = sessions
    app.state.instance_id = instance.id
    app.state.metrics = metrics
    app.state.reconciler = reconciler
    app.add_exception_handler(LlmgwError, _on_llmgw_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(IntegrityError, _on_integrity_error)
    app.add_exception_handler(DataError, _on_data_error)
    app.add_exception_handler(StaleDataError, _on_stale)
    # What is left of DBAPIError (OperationalError, InterfaceError): Postgres is unreachable.
    app.add_exception_handler(DBAPIError, _on_db_unavailable)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)

    # add_middleware wraps outside what is already there: the last added runs first.
    app.add_middleware(
        BodyGuard,
        max_body_bytes=settings.admin_max_body_bytes,
        setting="controlplane.admin_max_body_bytes",
        json_prefixes=("/admin/",),
        # The console checks its session cookie first, then reads at most a small form itself.
        skip_prefixes=("/agent/", "/ui/"),
    )
    app.add_middleware(AdminAuth, token=settings.admin_token, prefix="/admin")
    app.add_middleware(RequestLog, listener="internal", internal_error=_internal_error)

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

    @app.get("/metrics", tags=["health"], include_in_schema=False)
    async def prometheus_metrics() -> Response:
        """Prometheus exposition of this process's metrics (internal listener only)."""
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    app.include_router(admin_router)
    # The web console at /ui: pages over the admin API, behind its own sign-in.
    intake = kv_intake if kv_intake is not None else ShardViews()
    console = install_console(app, admin_token=settings.admin_token, registry=metrics, kv=intake)
    # Registration, sync and KV deltas; starts and stops with the app (heartbeats, instances).
    install_agent_api(
        app,
        settings=settings.agent_api,
        sessions=sessions,
        instance=instance,
        registry=metrics,
        intake=intake,
    )
    return app


def _advertise_url(settings: ControlPlaneSettings) -> str:
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    host = settings.internal_host
    if host in ("0.0.0.0", "::", ""):
        # A wildcard is where we listen, not where anyone can reach us.
        host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.internal_port}"


def _plan_settings(r: ReconcileSettings) -> PlanSettings:
    try:
        return PlanSettings(
            sync_period_s=r.sync_period_s,
            sync_grace_s=r.node_grace_s,
            drain_timeout_s=r.drain_timeout_s,
            crash_loop_restarts=r.crash_loop_restarts,
            leader_port_min=r.leader_port_min,
            leader_port_max=r.leader_port_max,
        )
    except ConfigError as exc:
        raise ConfigError(exc.message, field=f"controlplane.reconcile.{exc.field}") from None
