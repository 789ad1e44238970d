"""`llmgw engines ...` (owned by the [engines] work; placeholder until it lands)."""

import typer

app = typer.Typer(help="Show the exact commands llmgw would start for a shard.", no_args_is_help=True)
