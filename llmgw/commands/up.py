"""`llmgw up`: the all-in-one on this machine (the llmgw.up package does the work)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from llmgw.commands._common import ConfigOption, exit_on_error

__all__ = ["up"]

Port = Annotated[int | None, typer.Option(min=1, max=65535, show_default=False)]


@exit_on_error
def up(
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where Postgres, the agent's state, tokens, the API key, logs and up.json live. "
            "Default: $XDG_DATA_HOME/llmgw (/var/lib/llmgw as root).",
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Port of the public listener (the OpenAI API), the only one --host exposes. "
            "Default: gateway.port (8080).",
        ),
    ] = None,
    admin_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Port of the internal listener (admin API), on controlplane.internal_host "
            "(127.0.0.1 by default), never on --host. Default: controlplane.internal_port if "
            "configured, else --port + 1.",
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            help="Address of the public listener (--port) only; the admin API stays on "
            "controlplane.internal_host. Default: gateway.host (127.0.0.1).",
        ),
    ] = None,
    no_demo: Annotated[
        bool,
        typer.Option(
            "--no-demo",
            help="Do not apply the demo (config/demo.yaml: a model on the simulator engine with "
            "two replicas and a LoRA adapter). It is applied on the first run only.",
        ),
    ] = False,
    sim_gpus: Annotated[
        int,
        typer.Option(
            "--sim-gpus",
            min=0,
            max=64,
            help="Simulated GPUs (class sim), on a node of their own; this machine's real "
            "GPUs (NVML), if any, are offered too, by a second agent. 0: real GPUs only.",
        ),
    ] = 8,
    gateway_workers: Annotated[
        int,
        typer.Option(
            "--gateway-workers",
            min=0,
            max=64,
            help="Serve the OpenAI API from this many `llmgw gateway` processes of its own, "
            "apart from the control plane (a flood on it cannot delay syncs or operators). "
            "0: the control plane serves it too.",
        ),
    ] = 1,
    config: ConfigOption = None,
) -> None:
    """Run everything on this machine: a private Postgres, the control plane, a node agent
    with simulated GPUs, and a demo model; then print the OpenAI URL, an API key and examples.

    Every piece is supervised: one that dies is restarted alone. Ctrl-C stops engines, agent,
    control plane and Postgres, in that order; the next run resumes with the same data and key.
    """
    from llmgw.config import default_data_dir, load_settings
    from llmgw.logs import configure_logging
    from llmgw.up.launcher import AllInOne
    from llmgw.up.options import UpOptions

    settings = load_settings(config)
    configure_logging(settings.log.level, json=settings.log.json_lines)
    chosen = data_dir or (
        Path(settings.up.data_dir) if settings.up.data_dir else default_data_dir()
    )
    public_port = port if port is not None else settings.gateway.port
    if admin_port is None:
        # A port set in the config or environment wins over the "public + 1" convention.
        explicit = "internal_port" in settings.controlplane.model_fields_set
        admin_port = settings.controlplane.internal_port if explicit else public_port + 1
    opts = UpOptions(
        data_dir=chosen.expanduser().absolute(),
        host=host if host is not None else settings.gateway.host,
        port=public_port,
        admin_port=admin_port,
        demo=settings.up.demo and not no_demo,
        log_level=settings.log.level,
        config_path=config,
        internal_host=settings.controlplane.internal_host,
        sim_gpus=sim_gpus,
        agent_listen_host=settings.agent.listen_host,
        gateway_workers=gateway_workers,
    )
    aio = AllInOne(opts, say=lambda msg: typer.echo(msg, err=True), show=typer.echo)
    # SIGHUP too: a closed terminal or ssh session is a request to stop, not a reason to leave
    # Postgres and the control plane running without their supervisor.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, aio.request_stop)
    raise typer.Exit(aio.run())
