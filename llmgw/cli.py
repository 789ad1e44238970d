"""The `llmgw` command: assembles the subcommands of `llmgw/commands/`."""

from __future__ import annotations

import typer

from llmgw.commands import controlplane, db, engines, kv, simengine, up

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
app.add_typer(kv.app, name="kv")
app.add_typer(engines.app, name="engines")
app.command(
    "simengine",
    context_settings={"allow_extra_args": False},
    help="Run the simulator engine (what the `sim` engine adapter starts).",
)(simengine.simengine)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
