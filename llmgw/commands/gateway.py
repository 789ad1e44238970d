"""`llmgw gateway`: serve the public OpenAI listener in processes of its own.

The control plane then runs with ``--no-public-listener``: a flood on the public API cannot
delay its syncs, the leader's passes or the operators. The gateway reads the control plane's
database (``controlplane.database_url``, the same settings file or environment) and takes KV
deltas from agents on a private listener (``--private-host``/``--private-port``, a free port
by default), registered in the database so that agents find it (llmgw/serve/gateway_process.py).
"""

from __future__ import annotations

from typing import Annotated

import typer

from llmgw.commands._common import ConfigOption, exit_on_error

__all__ = ["gateway"]


@exit_on_error
def gateway(
    config: ConfigOption = None,
    host: Annotated[
        str | None, typer.Option(help="Public (OpenAI API) address (overrides gateway.host).")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Public (OpenAI API) port (overrides gateway.port).")
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            max=64,
            help="Worker processes sharing the public port (SO_REUSEPORT); each is its own "
            "instance with its own KV index and per-key limits.",
        ),
    ] = 1,
    private_host: Annotated[
        str,
        typer.Option(help="Address of the private listener (KV deltas from agents, /metrics)."),
    ] = "127.0.0.1",
    private_port: Annotated[
        int, typer.Option(min=0, max=65535, help="Its port; 0 picks a free one per worker.")
    ] = 0,
    advertise_url: Annotated[
        str,
        typer.Option(help="Where agents reach the private listener (one worker only)."),
    ] = "",
) -> None:
    """Serve the OpenAI API alone; KV deltas from agents arrive on a private listener."""
    overrides: dict[str, dict[str, object]] = {}
    for key, value in (("host", host), ("port", port)):
        if value is not None:
            overrides.setdefault("gateway", {})[key] = value
    from llmgw.serve.gateway_process import GatewayOptions, run_gateway

    run_gateway(
        config,
        overrides,
        GatewayOptions(
            workers=workers,
            private_host=private_host,
            private_port=private_port,
            advertise_url=advertise_url,
        ),
    )
