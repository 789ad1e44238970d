"""The `llmgw` subcommands, one module each; `llmgw/cli.py` assembles them.

Each module defines a typer app or command and imports its heavy dependencies
inside the command functions, so `llmgw --help` and short tools start fast.
"""
