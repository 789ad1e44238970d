"""The control plane process (`llmgw controlplane`): its parts built once, both listeners served.

The one composition root. ``build_process`` builds what both listeners share, once: the
database engine and sessions, the metrics registry, this instance's identity, the one LISTEN
connection (``store.notify.NotifyHub``: the gateway's caches and the reconciler subscribe to
it), the KV index (the agent API feeds it, the gateway's router reads it) and the reconciler.
``build_apps`` hands them, explicitly, to the internal app (admin API, agent API, console, the
leader's reconciler) and the public app (the OpenAI gateway); ``serve_process`` runs the hub
around the listeners (``servers``: one event loop, one shutdown, config reload) and disposes
of the engine last.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `llmgw --help` need not load the whole server
    from collections.abc import Callable, Sequence

    from starlette.types import ASGIApp

    from llmgw.config import ControlPlaneSettings, Settings
    from llmgw.controlplane.internal_app import ControlPlaneParts
    from llmgw.serve.servers import Listener
    from llmgw.store.notify import NotifyHub

__all__ = [
    "Process",
    "build_apps",
    "build_process",
    "internal_with_gateway_metrics",
    "public_listener",
    "run_controlplane",
    "serve_process",
]


@dataclass(frozen=True, slots=True)
class Process:
    """What both listeners of one control plane process share."""

    # The engine and sessions, the registry, the instance, the KV index, the reconciler.
    parts: ControlPlaneParts
    # The process's one LISTEN connection.
    notify: NotifyHub


def build_process(cp: ControlPlaneSettings) -> Process:
    """Every shared part, once (ConfigError first if the settings cannot make one)."""
    from llmgw.controlplane.instances import InstanceIdentity, new_instance_id
    from llmgw.controlplane.internal_app import advertise_url, build_parts, check_settings
    from llmgw.embedded_postgres import libpq_url
    from llmgw.store.notify import NotifyHub

    check_settings(cp)
    instance = InstanceIdentity(new_instance_id(), advertise_url(cp))
    notify = NotifyHub(libpq_url(cp.database_url), application_name=f"llmgw-notify-{instance.id}")
    parts = build_parts(cp, instance, notify=notify)
    return Process(parts=parts, notify=notify)


def build_apps(settings: Settings, process: Process) -> tuple[ASGIApp, ASGIApp]:
    """The internal and the public app, over the same parts."""
    from llmgw.controlplane.internal_app import create_app
    from llmgw.gateway.apis.families import public_routes
    from llmgw.gateway.asgi import create_public_app

    parts = process.parts
    internal = create_app(settings.controlplane, parts=parts, public_routes=public_routes())
    public = create_public_app(
        settings.gateway,
        sessions=parts.sessions,
        notify=process.notify,
        registry=parts.registry,
        intake=parts.kv,
        instance_id=parts.instance.id,
    )
    return internal, public


async def serve_process(
    process: Process,
    listeners: Sequence[Listener],
    *,
    grace_s: float,
    fd_reserve: int,
    on_reload: Callable[[], None] | None = None,
) -> None:
    """Serve ``listeners`` (``servers.serve``) with the process's parts around them: the hub
    LISTENs from before the apps start until after they stopped, and the engine's pool is
    closed last, after the gateway's final usage flush."""
    from llmgw.serve.servers import serve

    await process.notify.start()
    try:
        await serve(listeners, grace_s=grace_s, fd_reserve=fd_reserve, on_reload=on_reload)
    finally:
        await process.notify.stop()
        await process.parts.engine.dispose()


def run_controlplane(
    config: Path | None, overrides: dict[str, dict[str, object]], *, public: bool = True
) -> None:
    """Load the settings (``config`` and ``overrides`` per section, re-read on SIGHUP), build
    both listeners' apps and serve them until SIGTERM. ``public`` False: the internal listener
    alone, the OpenAI API being served by `llmgw gateway` processes (``gateway_process``), so
    a flood on it cannot hold this process's loop (syncs, the leader's passes, operators)."""
    from llmgw import eventloop
    from llmgw.config import load_settings
    from llmgw.http.listeners import FD_RESERVE, ListenerLimits
    from llmgw.logs import configure_logging, get_logger, log_to_file
    from llmgw.serve.servers import ConfigReload, Listener

    settings = load_settings(config, **overrides)
    if settings.log.file:
        log_to_file(
            settings.log.file, max_bytes=settings.log.max_bytes, backups=settings.log.backups
        )
    configure_logging(settings.log.level, json=settings.log.json_lines)
    cp, gw = settings.controlplane, settings.gateway
    process = build_process(cp)
    if public:
        internal, public_app = build_apps(settings, process)
    else:
        internal, public_app = internal_with_gateway_metrics(settings, process), None
    listeners = [
        Listener(
            name="internal",
            app=internal,
            host=cp.internal_host,
            port=cp.internal_port,
            setting="controlplane.internal_port",
            limits=ListenerLimits.of("internal", cp, section="controlplane"),
        ),
    ]
    if public_app is not None:
        listeners.append(public_listener(settings, public_app))
    get_logger("llmgw.controlplane").info(
        "controlplane_starting",
        internal_url=f"http://{cp.internal_host}:{cp.internal_port}",
        public_url=f"http://{gw.host}:{gw.port}" if public_app is not None else None,
    )
    # SIGHUP re-reads the same sources (file, environment, these flags) and applies what can
    # change live; see ConfigReload.
    reload = ConfigReload(
        lambda: load_settings(config, **overrides),
        settings,
        reconciler=process.parts.reconciler,
    )
    # Besides its listeners' connections the process holds the database pool (up to twice
    # its size on bursts) and the gateway's connections to engines.
    fd_reserve = FD_RESERVE + 2 * cp.db_pool_size
    if public_app is not None:
        fd_reserve += gw.upstream_pool_size
    eventloop.run(
        serve_process(
            process, listeners, grace_s=cp.shutdown_grace_s, fd_reserve=fd_reserve, on_reload=reload
        )
    )


def internal_with_gateway_metrics(settings: Settings, process: Process) -> ASGIApp:
    """The internal app of a control plane without a public listener: its registry also
    yields the `llmgw gateway` processes' metrics (``gateway_metrics``), read in the
    background while the app runs, so /metrics, `llmgw status` and the console still show
    routing."""
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager
    from typing import Any

    from llmgw.controlplane.internal_app import create_app
    from llmgw.gateway.apis.families import public_routes
    from llmgw.serve.gateway_metrics import GatewayMetrics

    app = create_app(settings.controlplane, parts=process.parts, public_routes=public_routes())
    gateways = GatewayMetrics(lambda: app.state.agent_api.instances.live)
    process.parts.registry.register(gateways)
    outer = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with outer(a) as state:
            gateways.start()
            try:
                yield state
            finally:
                await gateways.stop()

    app.router.lifespan_context = lifespan
    return app


def public_listener(settings: Settings, app: ASGIApp, *, reuse_port: bool = False) -> Listener:
    """The public (OpenAI API) listener on ``gateway.host:port`` under its limits."""
    from llmgw.http.listeners import ListenerLimits
    from llmgw.serve.servers import Listener

    gw = settings.gateway
    return Listener(
        name="public",
        app=app,
        host=gw.host,
        port=gw.port,
        setting="gateway.port",
        limits=ListenerLimits.of("public", gw, section="gateway"),
        reuse_port=reuse_port,
    )
