"""The server's roles and the application's database: ``SUPERUSER``, whom initdb makes, and
``APP_ROLE``, which owns the `llmgw` database and its schema and is all the application
connects as; made, or brought back to that shape, on every start.

What it must NOT do: run application SQL (the tables are the migrations'), log a password, or
give APP_ROLE anything beyond its own database.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import psycopg
from psycopg import sql

from llmgw.embedded_postgres._databases import libpq_url
from llmgw.embedded_postgres._process import write_private

__all__ = ["APP_DB", "APP_ROLE", "SUPERUSER", "app_password", "ensure_app_database"]

SUPERUSER = "llmgw"
# What the application connects as: owner of the `llmgw` database and its schema, nothing more.
# A superuser there could read any file the server can (COPY ... FROM), run programs
# (COPY ... PROGRAM) and turn off every constraint (session_replication_role): one SQL injection
# or leaked URL would be the whole machine instead of the fleet's state.
APP_ROLE = "llmgw_app"
APP_DB = "llmgw"


def app_password(path: Path) -> str:
    """APP_ROLE's password, kept in the 0600 file ``path`` (made on first use)."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        password = secrets.token_urlsafe(24)
        write_private(path, password + "\n", None)
        return password


def ensure_app_database(admin_url: str, superuser_url: str, password: str) -> None:
    """The `llmgw` database, owned by the non-superuser APP_ROLE, whose password is set to
    ``password`` on every start (so its file wins). ``admin_url`` is the superuser's URL of
    the maintenance database, ``superuser_url`` the superuser's of `llmgw`."""
    role = sql.Identifier(APP_ROLE)
    with psycopg.connect(libpq_url(admin_url), autocommit=True, connect_timeout=10) as c:
        exists = c.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (APP_ROLE,)).fetchone()
        # Client-side literal: utility statements take no bind parameters. The statement
        # is never logged (log_statement = none, log_min_error_statement = panic).
        stmt = sql.SQL(
            "{} ROLE {} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION "
            "NOBYPASSRLS PASSWORD {}"
        ).format(sql.SQL("ALTER" if exists else "CREATE"), role, sql.Literal(password))
        c.execute(stmt)
        row = c.execute(
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = %s", (APP_DB,)
        ).fetchone()
        if row is None:
            stmt = sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(APP_DB), role)
            if c.info.server_version >= 150000:
                # 15's default (WAL_LOG) writes the whole template through the WAL: 0.3 s on
                # a fresh cluster against 0.02 s for a file copy plus an empty checkpoint.
                stmt = sql.SQL("{} STRATEGY FILE_COPY").format(stmt)
            c.execute(stmt)
        elif row[0] != APP_ROLE:
            c.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(sql.Identifier(APP_DB), role))
        else:
            return
    # A new database, or one an older llmgw made as the superuser: the role takes over the
    # schema and everything in it, so migrations run as the role can alter what exists.
    with psycopg.connect(libpq_url(superuser_url), autocommit=True, connect_timeout=10) as c:
        c.execute(sql.SQL("ALTER SCHEMA public OWNER TO {}").format(role))
        c.execute(sql.SQL(_REASSIGN_PUBLIC).format(role=sql.Literal(APP_ROLE)))


# Hands the superuser's tables, views, standalone sequences and functions in `public` to the
# app role (a sequence owned by a column follows its table; altering it directly is refused).
_REASSIGN_PUBLIC = """
DO $$
DECLARE
    r record;
    app text := {role};
BEGIN
    FOR r IN
        SELECT c.oid::regclass AS name FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace AND c.relowner <> app::regrole
          AND (c.relkind IN ('r', 'p', 'v')
               OR (c.relkind = 'S' AND NOT EXISTS (
                   SELECT 1 FROM pg_depend d WHERE d.objid = c.oid AND d.deptype IN ('a', 'i'))))
    LOOP
        EXECUTE format('ALTER TABLE %s OWNER TO %I', r.name, app);
    END LOOP;
    FOR r IN
        SELECT p.oid::regprocedure AS name FROM pg_proc p
        WHERE p.pronamespace = 'public'::regnamespace AND p.proowner <> app::regrole
          AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = p.oid AND d.deptype = 'e')
    LOOP
        EXECUTE format('ALTER ROUTINE %s OWNER TO %I', r.name, app);
    END LOOP;
END
$$
"""
