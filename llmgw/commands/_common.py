"""What every long-running subcommand shares: the --config option and turning
llmgw's own errors into a clear message and exit status instead of a trace."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from llmgw.errors import LlmgwError

__all__ = ["ConfigOption", "exit_on_error", "fail"]

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        envvar="LLMGW_CONFIG",
        help="TOML config file (config/llmgw.toml documents every key). LLMGW_* variables override it.",
        show_default=False,
    ),
]

T = TypeVar("T")


def fail(message: str, status: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(status)


def exit_on_error(fn: Callable[..., T]) -> Callable[..., T]:
    """Report an LlmgwError as `error: <message>` with exit status 2."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except LlmgwError as exc:
            typer.echo(f"error: {exc.message}", err=True)
            sys.exit(2)

    return wrapper
