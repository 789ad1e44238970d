"""The schema the migrations build is the schema the models declare, compared as Postgres sees it.

Alembic's autogenerate comparison (test_migrations.py) skips what it does not model: CHECK
expressions, server defaults it cannot compare, partial-index predicates, exclusion
constraints, triggers. Here both schemas are built for real, `alembic upgrade head` in one
database and `metadata.create_all` in another, dumped with `pg_dump --schema-only`, and diffed
statement by statement: a `tp >= 7` in tables.py that no migration made shows up as a line.
"""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess

import psycopg
import pytest
from sqlalchemy import CheckConstraint, DefaultClause, MetaData, create_engine, pool, text

from llmgw.embedded_postgres import find_bin_dir, libpq_url
from llmgw.store import migrations
from llmgw.store.tables import NAMING, Base
from tests.pg_harness import PgServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def _pg_dump() -> str:
    # The server's own pg_dump first: an older one on PATH refuses a newer server.
    try:
        candidate = find_bin_dir() / "pg_dump"
        if candidate.is_file():
            return str(candidate)
    except Exception:
        pass
    found = shutil.which("pg_dump")
    if found is None:
        pytest.fail("pg_dump not found: install the PostgreSQL client (it ships with the server)")
    return found


def _schema(url: str) -> list[str]:
    done = subprocess.run(
        [
            _pg_dump(),
            "--schema-only",
            "--no-owner",
            "--no-privileges",
            "--no-comments",
            "--exclude-table=alembic_version",
            "--dbname",
            libpq_url(url),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return normalise(done.stdout)


def normalise(dump: str) -> list[str]:
    """pg_dump's statements, minus comments and session settings, one per entry, sorted.

    Sorted: the two builds create objects in different orders (and pg_dump follows creation
    order within a kind), which says nothing about the schema.
    """
    lines = [
        line
        for line in dump.splitlines()
        if line.strip() and not line.startswith("--") and not line.startswith("\\")
    ]
    statements = re.split(r";\n(?=\S|$)", "\n".join(lines) + "\n")
    return sorted(
        _sort_table_body(s.strip())
        for s in statements
        if s.strip() and not re.match(r"(SET |SELECT pg_catalog\.set_config)", s.strip())
    )


def _sort_table_body(statement: str) -> str:
    # A column added by a migration lands at the end of the table, while tables.py declares it
    # where it reads best: column order is not what this test guards, so each CREATE TABLE
    # lists its columns and constraints sorted, one per line.
    head, sep, rest = statement.partition(" (\n")
    if not head.startswith("CREATE TABLE") or not sep or not rest.endswith("\n)"):
        return statement
    items: list[str] = []
    current: list[str] = []
    depth, quoted = 0, False
    for ch in rest[: -len("\n)")]:
        if ch == "'":
            quoted = not quoted
        elif not quoted and ch == "(":
            depth += 1
        elif not quoted and ch == ")":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    items.append("".join(current).strip())
    return head + " (\n    " + ",\n    ".join(sorted(items)) + "\n)"


def diff(migrated: list[str], declared: list[str]) -> list[str]:
    """Changed lines only: `-` as the migrations build it, `+` as tables.py declares it."""
    return [
        line
        for line in difflib.unified_diff(
            "\n\n".join(migrated).splitlines(),
            "\n\n".join(declared).splitlines(),
            "alembic upgrade head",
            "metadata.create_all",
            n=2,
            lineterm="",
        )
    ]


def build_from_metadata(url: str, metadata: MetaData = Base.metadata) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS btree_gist")
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()


def test_migrated_schema_equals_declared_schema(pg_server: PgServer, empty_db_url: str) -> None:
    name = pg_server.new_name("declared")
    declared_url = pg_server.create_database(name, template="template0")
    try:
        migrations.upgrade(empty_db_url)
        build_from_metadata(declared_url)
        migrated, declared = _schema(empty_db_url), _schema(declared_url)
    finally:
        pg_server.drop_database(name)
    assert any("CREATE TABLE public.profiles" in s for s in migrated), migrated[:5]
    changes = diff(migrated, declared)
    assert not changes, "\n".join(changes)


def test_the_comparison_sees_what_autogenerate_missed(
    pg_server: PgServer, empty_db_url: str
) -> None:
    """The three drifts that slipped past the autogenerate comparison, made in a copy of the
    models (a CHECK, a server default, a partial-index predicate), each show up in the diff."""
    drifted = MetaData(naming_convention=NAMING)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(drifted)
    profiles, shards = drifted.tables["profiles"], drifted.tables["shards"]
    (tp_check,) = (c for c in profiles.constraints if c.name == "ck_profiles_tp_positive")
    assert isinstance(tp_check, CheckConstraint)
    tp_check.sqltext = text("tp >= 7")
    profiles.c.kv_block_size.server_default = DefaultClause(text("32"))
    (port_index,) = (i for i in shards.indexes if i.name == "uq_shards_node_leader_port_live")
    port_index.dialect_options["postgresql"]["where"] = text("NOT released")

    name = pg_server.new_name("drifted")
    drifted_url = pg_server.create_database(name, template="template0")
    try:
        migrations.upgrade(empty_db_url)
        build_from_metadata(drifted_url, drifted)
        found = "\n".join(diff(_schema(empty_db_url), _schema(drifted_url)))
    finally:
        pg_server.drop_database(name)
    assert "CHECK ((tp >= 7))" in found, found
    assert "kv_block_size integer DEFAULT 32" in found, found
    assert (
        "uq_shards_node_leader_port_live ON public.shards USING btree (node_id, leader_port) WHERE (NOT released)"
        in found
    ), found
