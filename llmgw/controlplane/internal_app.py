"""The control plane's internal HTTP application: health, readiness, docs and the admin API.

Errors leave as ``{"error": {"code", "message", "field"}}``, each with the status and
code of its type in ``llmgw.errors``; the handlers, database errors' among them, are
``llmgw.controlplane.admin.errors``.

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
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from llmgw.config import ControlPlaneSettings, ReconcileSettings
from llmgw.controlplane.admin.api import admin_router
from llmgw.controlplane.admin.errors import install_error_handlers, internal_error_body
from llmgw.controlplane.agentapi.endpoints import install_agent_api
from llmgw.controlplane.console import install_console
from llmgw.controlplane.instances import InstanceIdentity, listener_url, new_instance_id
from llmgw.controlplane.reconcile.loop import ReconcileMetrics, Reconciler
from llmgw.embedded_postgres import libpq_url
from llmgw.errors import ConfigError
from llmgw.http.admin_auth import AdminAuth
from llmgw.http.body_guard import BodyGuard
from llmgw.http.request_log import RequestLog
from llmgw.http.throttle import AuthThrottle
from llmgw.kv.shard_views import ShardViews
from llmgw.planner.snapshot import PlanSettings
from llmgw.protocol.sync import KV_PATH, SYNC_PATH
from llmgw.store import migrations
from llmgw.store.database import create_engine, session_factory
from llmgw.store.notify import NotifyHub

__all__ = [
    "ControlPlaneParts",
    "advertise_url",
    "build_parts",
    "build_reconciler",
    "check_settings",
    "create_app",
    "plan_settings",
]


@dataclass(frozen=True, slots=True)
class ControlPlaneParts:
    """What the internal app shares with the rest of its process, built once by the process's
    composition root (``llmgw.serve.process``): the gateway on the public listener reads the
    same database, registry and KV views, and reports demand under the same instance id."""

    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    registry: CollectorRegistry
    instance: InstanceIdentity
    # This process's prefix index, fed by agents' KV deltas; the gateway's router reads it.
    kv: ShardViews
    reconciler: Reconciler | None


def check_settings(settings: ControlPlaneSettings) -> None:
    """ConfigError unless the database URL and the admin token are set."""
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


def create_app(
    settings: ControlPlaneSettings,
    *,
    parts: ControlPlaneParts | None = None,
    public_routes: Sequence[Mapping[str, str]] = (),
) -> FastAPI:
    """Build the internal app. The database URL and admin token must be set.

    ``public_routes``: the public listener's routes (``gateway.apis.families.public_routes``,
    handed over by the composition root: this package does not import the gateway), listed
    in the OpenAPI document as ``x-llmgw-public-routes`` so one document names every route.

    Its lifespan runs the reconcile loop (``parts.reconciler``, None when
    ``controlplane.reconcile.enabled`` is off), which passes only while this process holds
    the leader lock. ``parts`` None (an app alone, in a test): the app builds its own and
    disposes of its engine when it stops; given, their owner (``serve``) does.
    """
    check_settings(settings)
    own = parts is None
    if parts is None:
        identity = InstanceIdentity(new_instance_id(), advertise_url(settings))
        parts = build_parts(settings, identity, notify=None)
    engine, sessions, metrics = parts.engine, parts.sessions, parts.registry
    instance, reconciler = parts.instance, parts.reconciler
    head = migrations.head_revision()

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
            if own:
                await engine.dispose()

    app = FastAPIOffline(
        title="llmgw control plane",
        version="v1",
        description="Admin API of llmgw: models, profiles, deployments.",
        lifespan=lifespan,
    )
    app.state.admin_token = settings.admin_token
    if public_routes:
        _list_public_routes(app, public_routes)
    app.state.sessions = sessions
    install_error_handlers(app)

    # add_middleware wraps outside what is already there: the last added runs first.
    app.add_middleware(
        BodyGuard,
        max_body_bytes=settings.admin_max_body_bytes,
        setting="controlplane.admin_max_body_bytes",
        json_prefixes=("/admin/",),
        # The console checks its session cookie first, then reads at most a small form itself.
        skip_prefixes=("/agent/", "/ui/"),
    )
    # One budget of wrong admin tokens for the Bearer check and the console's sign-in.
    throttle = AuthThrottle()
    app.add_middleware(AdminAuth, token=settings.admin_token, prefix="/admin", throttle=throttle)
    app.add_middleware(
        RequestLog,
        listener="internal",
        internal_error=internal_error_body,
        # Every agent's routine traffic (a sync every ~2 s, KV deltas): debug when it succeeds.
        quiet_paths=(SYNC_PATH, KV_PATH),
    )

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
    intake = parts.kv
    console = install_console(
        app, admin_token=settings.admin_token, registry=metrics, kv=intake, throttle=throttle
    )
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


def build_parts(
    settings: ControlPlaneSettings,
    instance: InstanceIdentity,
    *,
    notify: NotifyHub | None,
    reconcile: bool = True,
) -> ControlPlaneParts:
    """The parts over ``settings``' database for the process ``instance``: a reconciler unless
    ``reconcile`` is off (a gateway process) or the settings turn it off, its NOTIFYs through
    ``notify`` (None: a LISTEN connection of its own)."""
    engine = create_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        connect_timeout_s=settings.db_connect_timeout_s,
    )
    sessions = session_factory(engine)
    registry = CollectorRegistry()
    reconciler = (
        build_reconciler(
            settings, sessions=sessions, registry=registry, instance_id=instance.id, notify=notify
        )
        if reconcile
        else None
    )
    return ControlPlaneParts(engine, sessions, registry, instance, ShardViews(), reconciler)


def build_reconciler(
    settings: ControlPlaneSettings,
    *,
    sessions: async_sessionmaker[AsyncSession],
    registry: CollectorRegistry,
    instance_id: str,
    notify: NotifyHub | None,
) -> Reconciler | None:
    """The process's reconciler (None: ``controlplane.reconcile.enabled`` is off); its
    NOTIFYs come through ``notify`` (None: a LISTEN connection of its own)."""
    if not settings.reconcile.enabled:
        return None
    return Reconciler(
        sessions=sessions,
        libpq_url=libpq_url(settings.database_url),
        instance_id=instance_id,
        plan_settings=plan_settings(settings.reconcile),
        tick_s=settings.reconcile.tick_s,
        metrics=ReconcileMetrics.create(registry),
        notify=notify,
    )


def advertise_url(settings: ControlPlaneSettings) -> str:
    """Where agents reach this process's internal listener."""
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    return listener_url(settings.internal_host, settings.internal_port)


def plan_settings(r: ReconcileSettings) -> PlanSettings:
    """The reconcile settings as the planner's rules (a config reload converts them alike)."""
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


def _list_public_routes(app: FastAPI, routes: Sequence[Mapping[str, str]]) -> None:
    """The OpenAPI document, built once on first read as FastAPI builds it, plus the public
    routes as an extension (they are served by another listener, so not as `paths`)."""
    build = app.openapi
    rows = [dict(r) for r in routes]

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = build()
            doc["x-llmgw-public-routes"] = rows
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
