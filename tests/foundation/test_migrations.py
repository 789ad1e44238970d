"""Models and migrations agree; upgrade and downgrade work on real Postgres; DB-level invariants hold."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool

from llmgw.controlplane import migrations
from llmgw.controlplane.tables import Base
from llmgw.embedded_postgres import libpq_url

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)


def _diff(url: str) -> list[object]:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return list(compare_metadata(MigrationContext.configure(conn), Base.metadata))
    finally:
        engine.dispose()


def test_single_head() -> None:
    heads = ScriptDirectory.from_config(migrations.alembic_config()).get_heads()
    assert len(heads) == 1


def test_models_and_migrations_agree(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url)
    assert _diff(empty_db_url) == []


def test_downgrade_to_base_then_upgrade(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url)
    migrations.downgrade(empty_db_url, "base")
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public' AND table_name <> 'alembic_version'"
        ).fetchone()
    assert tables == (0,)
    migrations.upgrade(empty_db_url)
    assert migrations.current_revision(empty_db_url) == migrations.head_revision()
    assert _diff(empty_db_url) == []


@pytest.mark.parametrize("tool", ["alembic", "llmgw"])
def test_command_line_upgrade_on_empty_database(empty_db_url: str, tool: str) -> None:
    env = dict(os.environ, LLMGW_CONTROLPLANE__DATABASE_URL=empty_db_url)
    cmd = (
        [sys.executable, "-m", "alembic", "upgrade", "head"]
        if tool == "alembic"
        else [sys.executable, "-m", "llmgw", "db", "upgrade"]
    )
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert migrations.current_revision(empty_db_url) == migrations.head_revision()


def test_a_gpu_cannot_be_assigned_twice(db_url: str) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        node = conn.execute("INSERT INTO nodes (name) VALUES ('n1') RETURNING id").fetchone()[0]  # type: ignore[index]
        replica = conn.execute(
            "INSERT INTO replicas (profile_fingerprint) VALUES ('fp') RETURNING id"
        ).fetchone()[0]  # type: ignore[index]
        shards = [
            conn.execute(
                "INSERT INTO shards (replica_id, node_id, rank, profile_fingerprint, leader_port) "
                "VALUES (%s, %s, %s, 'fp', %s) RETURNING id",
                (replica, node, rank, 30000 + rank),
            ).fetchone()[0]  # type: ignore[index]
            for rank in (0, 1)
        ]
        conn.execute(
            "INSERT INTO gpu_assignments (node_id, gpu_key, shard_id) VALUES (%s, '0', %s)",
            (node, shards[0]),
        )
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(
                "INSERT INTO gpu_assignments (node_id, gpu_key, shard_id) VALUES (%s, '0', %s)",
                (node, shards[1]),
            )
        # The same leader port on one node is refused while both shards are live ...
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("UPDATE shards SET leader_port = 30000 WHERE id = %s", (shards[1],))
        # ... and allowed once the first is released.
        conn.execute("UPDATE shards SET released = true WHERE id = %s", (shards[0],))
        conn.execute("UPDATE shards SET leader_port = 30000 WHERE id = %s", (shards[1],))


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO deployments (name, model_id, profile_id, replicas) VALUES ('d', %(m)s, %(p)s, -1)",
        "INSERT INTO deployments (name, model_id, profile_id, max_surge, max_unavailable) VALUES ('d', %(m)s, %(p)s, '0', '0%%')",
        "UPDATE profiles SET tp = 0",
        "UPDATE profiles SET kv_hash_seed = '0'",
        # PYTHONHASHSEED takes only integers up to 2**32-1; anything else kills the engine.
        "UPDATE profiles SET kv_hash_seed = 'abc'",
        "UPDATE profiles SET kv_hash_seed = '4294967296'",
        "UPDATE profiles SET kv_hash_seed = '0042'",
    ],
)
def test_checks_are_enforced_by_the_database(db_url: str, statement: str) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        m = conn.execute("INSERT INTO models (name) VALUES ('m') RETURNING id").fetchone()[0]  # type: ignore[index]
        p = conn.execute(
            "INSERT INTO profiles (name, model_id, engine, model_path, kv_hash_seed, fingerprint) "
            "VALUES ('p', %s, 'sim', '/m', '12345', 'fp') RETURNING id",
            (m,),
        ).fetchone()[0]  # type: ignore[index]
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(statement, {"m": m, "p": p})


def test_the_clusters_default_seed_is_a_usable_pythonhashseed(db_url: str) -> None:
    from llmgw.engines import is_valid_hash_seed

    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute("SELECT kv_hash_seed FROM cluster_info").fetchone()
    assert row is not None and is_valid_hash_seed(row[0]), row
