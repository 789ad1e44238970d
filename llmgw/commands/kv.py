"""`llmgw kv ...` (owned by the [kv] work; placeholder until it lands)."""

import typer

app = typer.Typer(help="Inspect vLLM-compatible KV block hashes and events.", no_args_is_help=True)
