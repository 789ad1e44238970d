"""`llmgw up`: the all-in-one on this machine (embedded Postgres + control plane)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from llmgw.commands._common import ConfigOption, exit_on_error

__all__ = ["up"]


@exit_on_error
def up(
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where Postgres, the admin token and up.json live. Default: $XDG_DATA_HOME/llmgw."
        ),
    ] = None,
    port: Annotated[int, typer.Option(help="Port of the public OpenAI endpoint.")] = 8080,
    admin_port: Annotated[
        int | None,
        typer.Option(help="Port of the internal admin API. Default: --port + 1."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    no_demo: Annotated[
        bool,
        typer.Option("--no-demo", help="Do not create the demo model on the simulator engine."),
    ] = False,
    config: ConfigOption = None,
) -> None:
    """Run everything on this machine: a private Postgres, migrations, the control plane."""
    from llmgw.allinone import AllInOne, UpOptions
    from llmgw.config import default_data_dir, load_settings
    from llmgw.logs import configure_logging

    settings = load_settings(config)
    configure_logging(settings.log.level, json=settings.log.json_lines)
    chosen = data_dir or (
        Path(settings.up.data_dir) if settings.up.data_dir else default_data_dir()
    )
    opts = UpOptions(
        data_dir=chosen.expanduser().absolute(),
        host=host,
        port=port,
        admin_port=admin_port if admin_port is not None else port + 1,
        demo=settings.up.demo and not no_demo,
        log_level=settings.log.level,
        config_path=config,
    )
    aio = AllInOne(opts, say=lambda msg: typer.echo(msg, err=True))
    signal.signal(signal.SIGINT, aio.request_stop)
    signal.signal(signal.SIGTERM, aio.request_stop)
    raise typer.Exit(aio.run())
