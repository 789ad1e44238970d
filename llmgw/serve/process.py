"""The control plane process (`llmgw controlplane`): its parts built once, both listeners served.

The one composition root: it builds the KV index both listeners share (the agent API feeds it,
the gateway's router reads it), the internal app (admin API, agent API, console, the leader's
reconciler) and the public app (the OpenAI gateway), and serves them on one event loop with one
shutdown and config reload (``servers``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["run_controlplane"]


def run_controlplane(config: Path | None, overrides: dict[str, dict[str, object]]) -> None:
    """Load the settings (``config`` and ``overrides`` per section, re-read on SIGHUP), build
    both listeners' apps and serve them until SIGTERM."""
    from llmgw import eventloop
    from llmgw.config import load_settings
    from llmgw.controlplane.internal_app import create_app
    from llmgw.embedded_postgres import libpq_url
    from llmgw.gateway.asgi import create_public_app
    from llmgw.http.listeners import FD_RESERVE, ListenerLimits
    from llmgw.kv.shard_views import ShardViews
    from llmgw.logs import configure_logging, get_logger, log_to_file
    from llmgw.serve.servers import ConfigReload, Listener, serve

    settings = load_settings(config, **overrides)
    if settings.log.file:
        log_to_file(
            settings.log.file, max_bytes=settings.log.max_bytes, backups=settings.log.backups
        )
    configure_logging(settings.log.level, json=settings.log.json_lines)
    cp, gw = settings.controlplane, settings.gateway
    # One KV index per process: the agent API (internal listener) feeds it, the gateway's
    # router (public listener) reads it.
    intake = ShardViews()
    internal = create_app(cp, kv_intake=intake)
    public = create_public_app(
        gw,
        sessions=internal.state.sessions,
        libpq_url=libpq_url(cp.database_url),
        registry=internal.state.metrics,
        intake=intake,
        instance_id=internal.state.instance_id,
    )
    listeners = [
        Listener(
            name="internal",
            app=internal,
            host=cp.internal_host,
            port=cp.internal_port,
            setting="controlplane.internal_port",
            limits=ListenerLimits(
                listener="internal",
                max_connections=cp.max_connections,
                max_header_bytes=cp.max_header_bytes,
                header_timeout_s=cp.header_timeout_s,
                connections_setting="controlplane.max_connections",
                header_bytes_setting="controlplane.max_header_bytes",
            ),
        ),
        Listener(
            name="public",
            app=public,
            host=gw.host,
            port=gw.port,
            setting="gateway.port",
            limits=ListenerLimits(
                listener="public",
                max_connections=gw.max_connections,
                max_header_bytes=gw.max_header_bytes,
                header_timeout_s=gw.header_timeout_s,
                connections_setting="gateway.max_connections",
                header_bytes_setting="gateway.max_header_bytes",
            ),
        ),
    ]
    get_logger("llmgw.controlplane").info(
        "controlplane_starting",
        internal_url=f"http://{cp.internal_host}:{cp.internal_port}",
        public_url=f"http://{gw.host}:{gw.port}",
    )
    # SIGHUP re-reads the same sources (file, environment, these flags) and applies what can
    # change live; see ConfigReload.
    reload = ConfigReload(
        lambda: load_settings(config, **overrides),
        settings,
        reconciler=internal.state.reconciler,
    )
    # Besides its listeners' connections the process holds the database pool (up to twice
    # its size on bursts) and the gateway's connections to engines.
    fd_reserve = FD_RESERVE + 2 * cp.db_pool_size + gw.upstream_pool_size
    eventloop.run(
        serve(listeners, grace_s=cp.shutdown_grace_s, fd_reserve=fd_reserve, on_reload=reload)
    )
