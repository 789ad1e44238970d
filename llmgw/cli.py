"""The `llmgw` command: assembles the subcommands of `llmgw/commands/`."""

from __future__ import annotations

import typer

from llmgw.commands import controlplane, db, engines, get, kv, simengine, up

__all__ = ["app", "main"]

app = typer.Typer(
    name="llmgw",
    help="Manage an LLM inference fleet behind one OpenAI-compatible endpoint.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("up")(up.up)
app.add_typer(db.app, name="db")
app.command("controlplane")(controlplane.controlplane)
# The public OpenAI listener in processes of its own (llmgw/serve/gateway_process.py).
from llmgw.commands import gateway as _gateway  # noqa: E402

app.command("gateway")(_gateway.gateway)
app.add_typer(kv.app, name="kv")
app.add_typer(engines.app, name="engines")
app.command("get")(get.get)
# One screen of the whole fleet (llmgw/commands/status.py).
from llmgw.commands import status as _status  # noqa: E402

app.command("status")(_status.status)
# Declarative fleet admin against the admin API (llmgw/commands/{apply,nodes,deployments,tokens,keys,usage}.py).
from llmgw.commands import apply as _apply  # noqa: E402
from llmgw.commands import deployments as _deployments  # noqa: E402
from llmgw.commands import keys as _keys  # noqa: E402
from llmgw.commands import nodes as _nodes  # noqa: E402
from llmgw.commands import tokens as _tokens  # noqa: E402
from llmgw.commands import usage as _usage  # noqa: E402

app.command("apply")(_apply.apply)
app.add_typer(_nodes.app, name="nodes")
app.add_typer(_deployments.app, name="deployments")
app.add_typer(_tokens.app, name="tokens")
app.add_typer(_keys.app, name="keys")
app.command("usage")(_usage.usage)
app.command(
    "simengine",
    context_settings={"allow_extra_args": False},
    help="Run the simulator engine (what the `sim` engine adapter starts).",
)(simengine.simengine)
# The node agent and its per-shard wrapper (llmgw/nodeagent/).
from llmgw.commands import agent as _agent  # noqa: E402
from llmgw.commands import shardrun as _shardrun  # noqa: E402

app.command("agent")(_agent.agent)
app.command("shard-run", help="Run one shard's processes (started by `llmgw agent`).")(
    _shardrun.shard_run
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
