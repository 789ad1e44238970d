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

from llmgw.embedded_postgres import libpq_url
from llmgw.store import migrations
from llmgw.store.tables import Base

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
@pytest.mark.e2e
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


MIG_A = "MIG-5c3f6a7e-0000-4c1f-9a1e-1234567890ab"
MIG_B = "MIG-7d1e2b3c-1111-4c1f-9a1e-1234567890ab"


def _node_and_shards(
    conn: psycopg.Connection[tuple[object, ...]], n: int
) -> tuple[object, list[object]]:
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
        for rank in range(n)
    ]
    return node, shards


def _assign(
    conn: psycopg.Connection[tuple[object, ...]],
    shard: object,
    node: object,
    gpu: int,
    mig: str | None = None,
    position: int = 0,
) -> None:
    conn.execute(
        "INSERT INTO gpu_assignments (shard_id, position, node_id, gpu_index, mig_uuid) "
        "VALUES (%s, %s, %s, %s, %s)",
        (shard, position, node, gpu, mig),
    )


# (first holder, second holder, refused?) on one node: (gpu index, MIG slice or None).
@pytest.mark.parametrize(
    ("first", "second", "refused"),
    [
        ((3, None), (3, None), True),  # a whole GPU twice
        ((3, None), (3, MIG_A), True),  # whole, then a slice of it
        ((3, MIG_A), (3, None), True),  # a slice, then the whole GPU
        ((3, MIG_A), (3, MIG_A), True),  # the same slice twice
        ((3, MIG_A), (3, MIG_B), False),  # two slices of one GPU
        ((3, None), (4, None), False),  # two GPUs
        ((3, None), (4, MIG_A), False),  # a GPU and a slice of another
    ],
    ids=[
        "whole-whole",
        "whole-slice",
        "slice-whole",
        "slice-slice",
        "two-slices",
        "two-gpus",
        "other-gpu",
    ],
)
def test_the_database_refuses_double_booking_a_gpu(
    db_url: str, first: tuple[int, str | None], second: tuple[int, str | None], refused: bool
) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        node, shards = _node_and_shards(conn, 2)
        _assign(conn, shards[0], node, *first)
        if not refused:
            _assign(conn, shards[1], node, *second)
            return
        with pytest.raises((psycopg.errors.UniqueViolation, psycopg.errors.ExclusionViolation)):
            _assign(conn, shards[1], node, *second)
        # Released, the first shard no longer holds it: the same insert now succeeds.
        conn.execute("UPDATE shards SET released = true WHERE id = %s", (shards[0],))
        _assign(conn, shards[1], node, *second)
        # ... and un-released it would double-book, so that is refused too.
        with pytest.raises((psycopg.errors.UniqueViolation, psycopg.errors.ExclusionViolation)):
            conn.execute("UPDATE shards SET released = false WHERE id = %s", (shards[0],))


def test_an_assignment_is_on_its_shards_node(db_url: str) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        _, shards = _node_and_shards(conn, 1)
        other = conn.execute("INSERT INTO nodes (name) VALUES ('n2') RETURNING id").fetchone()[0]  # type: ignore[index]
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            _assign(conn, shards[0], other, 0)


def test_a_leader_port_is_freed_by_release(db_url: str) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        _, shards = _node_and_shards(conn, 2)
        # The same leader port on one node is refused while both shards are live ...
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("UPDATE shards SET leader_port = 30000 WHERE id = %s", (shards[1],))
        # ... and allowed once the first is released.
        conn.execute("UPDATE shards SET released = true WHERE id = %s", (shards[0],))
        conn.execute("UPDATE shards SET leader_port = 30000 WHERE id = %s", (shards[1],))


def test_0002_keeps_assignments_and_device_order_and_downgrades(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url, "0001_initial")
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        node = conn.execute("INSERT INTO nodes (name) VALUES ('n1') RETURNING id").fetchone()[0]  # type: ignore[index]
        replica = conn.execute(
            "INSERT INTO replicas (profile_fingerprint) VALUES ('fp') RETURNING id"
        ).fetchone()[0]  # type: ignore[index]
        shard = conn.execute(
            "INSERT INTO shards (replica_id, node_id, rank, profile_fingerprint, gpu_indices, "
            "gpu_uuids) VALUES (%s, %s, 0, 'fp', '{5,2}', %s) RETURNING id",
            (replica, node, ["", MIG_A]),
        ).fetchone()[0]  # type: ignore[index]
        for key in ("5", MIG_A, "7"):  # "7": held per the table, missing from the arrays
            conn.execute(
                "INSERT INTO gpu_assignments (node_id, gpu_key, shard_id) VALUES (%s, %s, %s)",
                (node, key, shard),
            )
    migrations.upgrade(empty_db_url)
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        rows = conn.execute(
            "SELECT position, gpu_index, mig_uuid FROM gpu_assignments WHERE shard_id = %s "
            "ORDER BY position",
            (shard,),
        ).fetchall()
    assert rows == [(0, 5, None), (1, 2, MIG_A), (2, 7, None)]
    migrations.downgrade(empty_db_url, "0001_initial")
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        keys = conn.execute("SELECT gpu_key FROM gpu_assignments ORDER BY gpu_key").fetchall()
        arrays = conn.execute("SELECT gpu_indices, gpu_uuids FROM shards").fetchone()
    assert sorted(k for (k,) in keys) == sorted(["5", MIG_A, "7"])
    assert arrays == ([5, 2, 7], ["", MIG_A, ""])


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
