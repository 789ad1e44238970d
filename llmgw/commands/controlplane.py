"""`llmgw controlplane`: serve the control plane's two listeners in one process.

The internal listener (``--host``/``--port``, default 127.0.0.1:8081) carries the
admin API, health, readiness and the docs; the public one (``--public-host``/
``--public-port``, the gateway's address) carries the OpenAI API only.
"""

from __future__ import annotations

from typing import Annotated

import typer

from llmgw.commands._common import ConfigOption, exit_on_error

__all__ = ["controlplane"]


@exit_on_error
def controlplane(
    config: ConfigOption = None,
    host: Annotated[
        str | None,
        typer.Option(help="Internal listener address (overrides controlplane.internal_host)."),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(help="Internal listener port (overrides controlplane.internal_port)."),
    ] = None,
    public_host: Annotated[
        str | None,
        typer.Option(help="Public (OpenAI API) listener address (overrides gateway.host)."),
    ] = None,
    public_port: Annotated[
        int | None,
        typer.Option(help="Public (OpenAI API) listener port (overrides gateway.port)."),
    ] = None,
) -> None:
    """Serve the OpenAI API on the public listener and the admin API, agent API, health,
    readiness and metrics on the internal listener."""
    from llmgw import eventloop
    from llmgw.config import load_settings
    from llmgw.controlplane.agentapi.kv_intake import KvIntake
    from llmgw.controlplane.internal_app import create_app
    from llmgw.controlplane.public_app import create_public_app
    from llmgw.controlplane.server import ConfigReload, Listener, serve
    from llmgw.embedded_postgres import libpq_url
    from llmgw.listeners import FD_RESERVE, ListenerLimits
    from llmgw.logs import configure_logging, get_logger, log_to_file

    overrides: dict[str, dict[str, object]] = {}
    for section, key, value in (
        ("controlplane", "internal_host", host),
        ("controlplane", "internal_port", port),
        ("gateway", "host", public_host),
        ("gateway", "port", public_port),
    ):
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    settings = load_settings(config, **overrides)
    if settings.log.file:
        log_to_file(
            settings.log.file, max_bytes=settings.log.max_bytes, backups=settings.log.backups
        )
    configure_logging(settings.log.level, json=settings.log.json_lines)
    cp, gw = settings.controlplane, settings.gateway
    # One KV index per process: the agent API (internal listener) feeds it, the gateway's
    # router (public listener) reads it.
    intake = KvIntake()
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
