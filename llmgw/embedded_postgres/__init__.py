"""A private PostgreSQL server run from the host's own binaries: `llmgw up` and the test harness.

What it holds: finding server binaries (_binaries); starting ``postgres`` on 127.0.0.1 plus a
unix socket inside its data dir, waiting until ready and stopping it (_server, with the OS side
in _process); ``initdb`` on first use (_initdb); the superuser, the app role and the `llmgw`
database it owns (_roles); where throwaway data dirs live (_throwaway); creating and dropping
databases on any server by URL (_databases).

Layout of a data dir (llmgw.config.default_data_dir() for `llmgw up`, a temp dir for tests)::

    <data_dir>/postgres/            PGDATA and the unix socket; owned by `postgres` under root
    <data_dir>/postgres.password    0600, the generated password of the `llmgw` superuser
    <data_dir>/postgres.app.password  0600, that of `llmgw_app`, which owns the `llmgw` database
    <data_dir>/postgres.log         0600, the server's stdout/stderr, appended per start; never
                                    statement text, parameters or failing rows (terse errors)
    <data_dir>/postgres.start.lock  flock held while a start is under way
    <data_dir>/owner.pid            throwaway dirs only: the pid that made it (for sweeping)

Any PostgreSQL 13 or newer works: the system's (PATH, /usr/lib/postgresql/*/bin) or the
`pgserver` wheel's.

Usage::

    with EmbeddedPostgres(throwaway=True) as pg:      # temp dir, fsync off, removed on stop
        engine = create_engine(pg.url)
    pg = EmbeddedPostgres(data_dir, progress=print)   # durable, reused next run
    url = pg.start(); ...; pg.stop()

What it must NOT do: run application SQL (migrations live in llmgw.controlplane), read
configuration (callers pass paths and ports), log the password, or touch a data dir a live
server holds. It is synchronous (subprocess, socket, psycopg) so the CLI and pytest fixtures
can use it as is.
"""

from __future__ import annotations

from llmgw.embedded_postgres._binaries import find_bin_dir
from llmgw.embedded_postgres._databases import (
    create_database,
    drop_database,
    libpq_url,
    url_with_database,
)
from llmgw.embedded_postgres._errors import DataDirInUseError, PostgresStartError
from llmgw.embedded_postgres._process import die_with_parent
from llmgw.embedded_postgres._roles import APP_ROLE, SUPERUSER
from llmgw.embedded_postgres._server import EmbeddedPostgres
from llmgw.embedded_postgres._throwaway import throwaway_parent

__all__ = [
    "APP_ROLE",
    "SUPERUSER",
    "DataDirInUseError",
    "EmbeddedPostgres",
    "PostgresStartError",
    "create_database",
    "die_with_parent",
    "drop_database",
    "find_bin_dir",
    "libpq_url",
    "throwaway_parent",
    "url_with_database",
]
