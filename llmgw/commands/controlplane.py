"""`llmgw controlplane`: serve the control plane's two listeners in one process.

The internal listener (``--host``/``--port``, default 127.0.0.1:8081) carries the
admin API, health, readiness and the docs; the public one (``--public-host``/
``--public-port``, the gateway's address) carries the OpenAI API only; with
``--no-public-listener`` the OpenAI API is left to `llmgw gateway` processes.
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
    public_listener: Annotated[
        bool,
        typer.Option(
            help="Serve the OpenAI API here too; --no-public-listener leaves it to `llmgw "
            "gateway` processes, so a flood on it cannot delay syncs, the leader or operators."
        ),
    ] = True,
) -> None:
    """Serve the OpenAI API on the public listener and the admin API, agent API, health,
    readiness and metrics on the internal listener."""
    overrides: dict[str, dict[str, object]] = {}
    for section, key, value in (
        ("controlplane", "internal_host", host),
        ("controlplane", "internal_port", port),
        ("gateway", "host", public_host),
        ("gateway", "port", public_port),
    ):
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    from llmgw.serve.process import run_controlplane

    run_controlplane(config, overrides, public=public_listener)
