"""`llmgw simengine` (owned by the [simengine] work; placeholder until it lands)."""

import typer


def simengine() -> None:
    """Run the simulator engine."""
    raise typer.Exit(1)
