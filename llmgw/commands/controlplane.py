"""`llmgw controlplane`: serve the control plane's internal API (admin, health)."""

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
) -> None:
    """Serve the admin API, health and readiness on the internal listener."""
    import uvicorn

    from llmgw.config import load_settings
    from llmgw.controlplane.app import create_app
    from llmgw.logs import configure_logging, get_logger

    cp: dict[str, object] = {}
    if host is not None:
        cp["internal_host"] = host
    if port is not None:
        cp["internal_port"] = port
    settings = load_settings(config, **({"controlplane": cp} if cp else {}))
    configure_logging(settings.log.level, json=settings.log.json_lines)
    app = create_app(settings.controlplane)
    get_logger("llmgw.controlplane").info(
        "controlplane_starting",
        internal_url=f"http://{settings.controlplane.internal_host}:{settings.controlplane.internal_port}",
    )
    uvicorn.run(
        app,
        host=settings.controlplane.internal_host,
        port=settings.controlplane.internal_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
