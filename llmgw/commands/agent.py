"""`llmgw agent`: run the node agent (llmgw/nodeagent/agent.py) until SIGTERM or Ctrl-C.

Stopping it leaves every engine running (they run under their own
wrappers); the next start adopts them. It runs on uvloop where installed, as the control
plane does (llmgw.eventloop): the proxy relays every token of every engine on this node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmgw.commands._common import ConfigOption, exit_on_error

__all__ = ["agent"]


@exit_on_error
def agent(
    config: ConfigOption = None,
    controlplane_url: Annotated[
        str | None, typer.Option("--controlplane-url", help="Internal URL of a control plane.")
    ] = None,
    bootstrap_token_file: Annotated[
        str | None,
        typer.Option(
            "--bootstrap-token-file",
            help="File holding the one-time registration token (or LLMGW_AGENT__BOOTSTRAP_TOKEN).",
        ),
    ] = None,
    state_dir: Annotated[
        str | None, typer.Option("--state-dir", help="Where the agent keeps its state.")
    ] = None,
    sim_gpus: Annotated[
        int | None, typer.Option("--sim-gpus", help="Simulated GPUs (class sim) instead of NVML.")
    ] = None,
    inventory_file: Annotated[
        str | None,
        typer.Option("--inventory-file", help="YAML/JSON inventory (GPUs, MIG, fabrics)."),
    ] = None,
    node_name: Annotated[str | None, typer.Option("--node-name")] = None,
    mgmt_addr: Annotated[
        str | None, typer.Option("--mgmt-addr", help="Address peers reach this node on.")
    ] = None,
    listen_port: Annotated[
        int | None, typer.Option("--listen-port", help="/healthz and /metrics port (0: any).")
    ] = None,
    stop_engines_on_exit: Annotated[
        bool,
        typer.Option(
            "--stop-engines-on-exit",
            help="Stop every engine before exiting (what `llmgw up` uses). Default: engines "
            "keep running and the next agent adopts them.",
        ),
    ] = False,
) -> None:
    """Run the node agent: register, sync, supervise engines."""
    import asyncio
    import signal

    from llmgw import eventloop
    from llmgw.config import default_data_dir, load_settings
    from llmgw.logs import configure_logging, log_to_file
    from llmgw.nodeagent.agent import Agent, AgentOptions

    flags: dict[str, object] = {
        k: v
        for k, v in {
            "controlplane_url": controlplane_url,
            "bootstrap_token_file": bootstrap_token_file,
            "state_dir": state_dir,
            "sim_gpus": sim_gpus,
            "inventory_file": inventory_file,
            "node_name": node_name,
            "mgmt_addr": mgmt_addr,
            "listen_port": listen_port,
        }.items()
        if v is not None
    }
    settings = load_settings(config, **({"agent": flags} if flags else {}))
    if settings.log.file:
        log_to_file(
            settings.log.file, max_bytes=settings.log.max_bytes, backups=settings.log.backups
        )
    configure_logging(settings.log.level, json=settings.log.json_lines)
    root = (
        Path(settings.agent.state_dir) if settings.agent.state_dir else default_data_dir() / "agent"
    )
    node_agent = Agent(
        settings.agent,
        AgentOptions(state_dir=root, stop_engines_on_exit=stop_engines_on_exit),
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await node_agent.run(stop)

    eventloop.run(main())
