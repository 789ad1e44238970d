"""Creating and dropping databases on any PostgreSQL server given an admin URL, and URL helpers.

Used by the embedded server and by the test harness against LLMGW_TEST_DATABASE_URL alike. Names
are checked and quoted as identifiers; nothing here runs application SQL.
"""

from __future__ import annotations

import re
import urllib.parse

import psycopg
from psycopg import sql

from llmgw.errors import ConfigError

__all__ = ["create_database", "drop_database", "libpq_url", "url_with_database"]

_DB_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def create_database(admin_url: str, name: str, *, template: str | None = None) -> str:
    """Create database ``name`` (cloned from ``template`` if given) and return its URL."""
    _check_db_name(name)
    stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        _check_db_name(template)
        stmt = sql.SQL("{} TEMPLATE {}").format(stmt, sql.Identifier(template))
    with psycopg.connect(libpq_url(admin_url), autocommit=True) as conn:
        conn.execute(stmt)
    return url_with_database(admin_url, name)


def drop_database(admin_url: str, name: str) -> None:
    """Drop ``name`` if it exists, ending its sessions (a leaked test pool must not block it)."""
    _check_db_name(name)
    stmt = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with psycopg.connect(libpq_url(admin_url), autocommit=True) as conn:
        conn.execute(stmt)


def url_with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name`` instead."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


def libpq_url(url: str) -> str:
    """The URL as libpq/psycopg takes it: SQLAlchemy's ``postgresql+psycopg://`` minus the driver."""
    # SQLAlchemy spells the driver into the scheme; libpq accepts only postgresql:// or postgres://.
    scheme, sep, rest = url.partition("://")
    return f"{scheme.split('+')[0]}{sep}{rest}"


def _check_db_name(name: str) -> None:
    if not _DB_NAME_RE.match(name):
        raise ConfigError(
            f"database name {name!r} must be 1-63 lowercase letters, digits or underscores, "
            "starting with a letter or underscore",
            field="database",
        )
