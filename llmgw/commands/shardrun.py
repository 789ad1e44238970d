"""`llmgw shard-run`: the per-shard wrapper the node agent starts (llmgw/nodeagent/shardrun.py).

Not for people to run: the launch arrives on stdin from the agent. Heavy
imports stay inside the function so `llmgw --help` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["shard_run"]


def shard_run(
    shard_dir: Annotated[
        str, typer.Option("--shard-dir", help="The shard's state directory (the agent's).")
    ],
) -> None:
    """Run one shard's processes from a launch read on stdin (started by `llmgw agent`)."""
    from llmgw.nodeagent.shardrun import main_from_stdin

    raise typer.Exit(main_from_stdin(shard_dir))
