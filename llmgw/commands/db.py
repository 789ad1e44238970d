"""`llmgw db ...`: migrate and inspect the state store's schema.

The database URL comes from the environment (LLMGW_CONTROLPLANE__DATABASE_URL),
the --config file, a file named by --database-url-file, or --database-url
without a password: argv is readable by every user on the host (`ps`), so a
password there is refused, naming the ways that keep it private (issue 8 item 7).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from llmgw.commands._common import ConfigOption, exit_on_error, fail

__all__ = ["app"]

app = typer.Typer(help="Migrate and inspect the state store (Postgres).", no_args_is_help=True)

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        help="Overrides controlplane.database_url; without a password (argv shows in `ps`).",
        show_default=False,
    ),
]
UrlFileOption = Annotated[
    Path | None,
    typer.Option(
        "--database-url-file",
        help="A file holding the database URL (with its password), e.g. mode 0600.",
        show_default=False,
        dir_okay=False,
    ),
]
# A URL is one line; more is the wrong file.
_MAX_URL_FILE_BYTES = 4096


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


def _given_url(database_url: str | None, database_url_file: Path | None) -> str | None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    if database_url and database_url_file:
        fail("pass --database-url or --database-url-file, not both")
    if database_url_file is not None:
        try:
            with database_url_file.open("rb") as f:
                raw = f.read(_MAX_URL_FILE_BYTES + 1)
        except OSError as exc:
            fail(f"cannot read --database-url-file {database_url_file}: {exc.strerror}")
        if len(raw) > _MAX_URL_FILE_BYTES:
            fail(f"--database-url-file {database_url_file} is not one URL (over 4 KiB)")
        lines = raw.decode("utf-8", errors="replace").strip().splitlines()
        if len(lines) != 1:
            # Never echo the content: the file holds a password.
            fail(f"--database-url-file {database_url_file} must hold one line, the URL")
        return lines[0].strip()
    if database_url:
        try:
            password = make_url(database_url).password
        except ArgumentError:
            password = None  # load_settings names what is wrong with it
        if password is not None:
            fail(
                "--database-url holds a password, which every user on this host can read "
                "in `ps`; set LLMGW_CONTROLPLANE__DATABASE_URL, put it in the --config "
                "file, or pass --database-url-file with a file that holds the URL "
                "(or use PGPASSFILE and a URL without a password)"
            )
    return database_url


def _url(config: object, database_url: str | None, database_url_file: Path | None = None) -> str:
    from llmgw.config import load_settings

    database_url = _given_url(database_url, database_url_file)
    overrides = {"controlplane": {"database_url": database_url}} if database_url else {}
    settings = load_settings(config, **overrides)  # type: ignore[arg-type]
    if not settings.controlplane.database_url:
        fail(
            "no database URL: set LLMGW_CONTROLPLANE__DATABASE_URL, put [controlplane] "
            "database_url in the --config file, or pass --database-url-file"
        )
    return settings.controlplane.database_url


@app.command()
@exit_on_error
def upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    config: ConfigOption = None,
    database_url: UrlOption = None,
    database_url_file: UrlFileOption = None,
) -> None:
    """Migrate the database to the newest schema (or REVISION). Safe to repeat."""
    from llmgw.store import migrations

    url = _url(config, database_url, database_url_file)
    with _reachable(url):
        migrations.upgrade(url, revision)
        typer.echo(f"database at {migrations.current_revision(url)}")


@app.command()
@exit_on_error
def current(
    config: ConfigOption = None,
    database_url: UrlOption = None,
    database_url_file: UrlFileOption = None,
) -> None:
    """Print the database's schema revision and the newest one this llmgw knows."""
    from llmgw.store import migrations

    url = _url(config, database_url, database_url_file)
    with _reachable(url):
        typer.echo(f"current: {migrations.current_revision(url) or '(empty)'}")
    typer.echo(f"head:    {migrations.head_revision()}")
