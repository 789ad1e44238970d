"""`llmgw db ...`: migrate and inspect the state store's schema."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated

import typer

from llmgw.commands._common import ConfigOption, exit_on_error, fail

__all__ = ["app"]

app = typer.Typer(help="Migrate and inspect the state store (Postgres).", no_args_is_help=True)

UrlOption = Annotated[
    str | None,
    typer.Option("--database-url", help="Overrides controlplane.database_url.", show_default=False),
]


@contextlib.contextmanager
def _reachable(url: str) -> Iterator[None]:
    """Turn "cannot connect" into one line naming the server and the likely fix."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    try:
        yield
    except OperationalError as exc:
        where = make_url(url).render_as_string(hide_password=True)
        reason = str(exc.orig).splitlines()[0] if exc.orig is not None else str(exc)
        fail(f"cannot reach the database at {where}: {reason}; is Postgres running there?")


def _url(config: object, database_url: str | None) -> str:
    from llmgw.config import load_settings

    overrides = {"controlplane": {"database_url": database_url}} if database_url else {}
    settings = load_settings(config, **overrides)  # type: ignore[arg-type]
    if not settings.controlplane.database_url:
        fail(
            "no database URL: pass --database-url, set LLMGW_CONTROLPLANE__DATABASE_URL, "
            "or put [controlplane] database_url in the --config file"
        )
    return settings.controlplane.database_url


@app.command()
@exit_on_error
def upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    config: ConfigOption = None,
    database_url: UrlOption = None,
) -> None:
    """Migrate the database to the newest schema (or REVISION). Safe to repeat."""
    from llmgw.controlplane import migrations

    url = _url(config, database_url)
    with _reachable(url):
        migrations.upgrade(url, revision)
        typer.echo(f"database at {migrations.current_revision(url)}")


@app.command()
@exit_on_error
def current(config: ConfigOption = None, database_url: UrlOption = None) -> None:
    """Print the database's schema revision and the newest one this llmgw knows."""
    from llmgw.controlplane import migrations

    url = _url(config, database_url)
    with _reachable(url):
        typer.echo(f"current: {migrations.current_revision(url) or '(empty)'}")
    typer.echo(f"head:    {migrations.head_revision()}")
