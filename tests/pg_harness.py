"""The throwaway-Postgres test harness behind the fixtures in tests/conftest.py.

One server per test session: a private cluster from llmgw.embedded_postgres (fsync off, temp dir,
run as `postgres` under root), or the server named by ``LLMGW_TEST_DATABASE_URL``, on which the
session may create and drop databases. A template database is migrated once; each test gets a
clone of it (CREATE DATABASE ... TEMPLATE copies files, far faster than running migrations).

What it must NOT do: fall back to SQLite or a mock when no server can start (the error says how
to install one), touch databases it did not create (all of its names carry this session's
prefix), or leave the template open to connections (a clone fails while any session is in it).
"""

from __future__ import annotations

import os
import secrets
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
from psycopg import sql

from llmgw.embedded_postgres import (
    EmbeddedPostgres,
    create_database,
    libpq_url,
    url_with_database,
)

__all__ = ["ENV_URL", "PgServer", "migrated_template", "pg_server_session"]

# An admin URL (SQLAlchemy or libpq form) of a server where the tests may CREATE DATABASE.
ENV_URL = "LLMGW_TEST_DATABASE_URL"


@dataclass(frozen=True, slots=True)
class PgServer:
    """The session's server: where to connect as an admin, and how to make databases there."""

    # SQLAlchemy URL of a database the admin can connect to (never a test database).
    admin_url: str
    # True for the private cluster this session started; False for LLMGW_TEST_DATABASE_URL.
    embedded: bool
    # Every database this session creates starts with it, so concurrent sessions on one
    # external server never drop each other's databases.
    prefix: str

    def new_name(self, kind: str) -> str:
        return f"{self.prefix}_{kind}_{secrets.token_hex(4)}"

    def url_for(self, name: str) -> str:
        return url_with_database(self.admin_url, name)

    def create_database(self, name: str, *, template: str | None = None) -> str:
        return create_database(self.admin_url, name, template=template)

    def allow_connections(self, db_url: str, allowed: bool) -> None:
        """Let the database at ``db_url`` take connections, or refuse them and end the sessions
        it has. To a client that is what a stopped Postgres looks like (a LISTEN connection
        drops, every new connection fails), and it comes back at once, unlike a restarted
        server whose port another test may have taken."""
        name = db_url.rsplit("/", 1)[1].split("?", 1)[0]
        with psycopg.connect(libpq_url(self.admin_url), autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {}").format(
                    sql.Identifier(name), sql.Literal(allowed)
                )
            )
            if not allowed:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (name,),
                )

    @contextmanager
    def offline(self, db_url: str) -> Iterator[None]:
        """The database at ``db_url`` refuses every connection until the block ends."""
        self.allow_connections(db_url, False)
        try:
            yield
        finally:
            self.allow_connections(db_url, True)

    def drop_database(self, name: str) -> None:
        """Drop a test's database; one the server cannot drop within ``_DROP_TIMEOUT_S`` is
        left (warned, with what every session was doing) rather than failing the test."""
        # DROP DATABASE waits for every backend of the cluster to absorb a signal barrier; in
        # two full runs on loaded 2-core machines one such wait outlived the test's timeout.
        # The database is this session's (its name carries the prefix; the private cluster
        # goes with the session), so leaving it costs nothing and the test's own result stands.
        try:
            with psycopg.connect(libpq_url(self.admin_url), autocommit=True) as conn:
                conn.execute(f"SET statement_timeout = '{_DROP_TIMEOUT_S}s'")
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
        except psycopg.errors.QueryCanceled:
            warnings.warn(
                f"test database {name} not dropped within {_DROP_TIMEOUT_S} s; left behind. "
                f"Sessions then: {self._activity()}",
                stacklevel=2,
            )

    def _activity(self) -> list[tuple[object, ...]]:
        with psycopg.connect(libpq_url(self.admin_url), autocommit=True) as conn:
            return conn.execute(
                "SELECT pid, datname, backend_type, state, wait_event_type, wait_event, "
                "left(query, 60) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            ).fetchall()


_DROP_TIMEOUT_S = 15


@contextmanager
def pg_server_session() -> Iterator[PgServer]:
    prefix = f"llmgw_test_{os.getpid()}_{secrets.token_hex(2)}"
    external = os.environ.get(ENV_URL)
    if external:
        yield PgServer(admin_url=_sqlalchemy_url(external), embedded=False, prefix=prefix)
        return
    with EmbeddedPostgres(throwaway=True) as pg:
        yield PgServer(admin_url=pg.admin_url, embedded=True, prefix=prefix)


@contextmanager
def migrated_template(server: PgServer) -> Iterator[str]:
    """Create and migrate the template database; yield its name; drop it at the end."""
    # Imported here: a harness that only needs empty databases must not depend on the
    # control plane importing cleanly.
    from llmgw.store.migrations import upgrade

    name = server.new_name("template")
    url = server.create_database(name)
    try:
        upgrade(url)
        _freeze(server.admin_url, name)
        yield name
    finally:
        # PostgreSQL refuses to drop a database marked as a template.
        with psycopg.connect(libpq_url(server.admin_url), autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE false").format(sql.Identifier(name))
            )
        server.drop_database(name)


def _freeze(admin_url: str, name: str) -> None:
    # A connection left open by the migration (a pooled engine not disposed) would make every
    # clone fail with "source database is being accessed by other users"; a test connecting to
    # the template by mistake would leak its writes into every later test. Close both doors.
    ident = sql.Identifier(name)
    with psycopg.connect(libpq_url(admin_url), autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false").format(ident)
        )
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
            (name,),
        )


def _sqlalchemy_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if scheme in ("postgres", "postgresql"):
        return f"postgresql+psycopg{sep}{rest}"
    return url
