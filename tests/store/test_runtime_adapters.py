"""``store.runtime_adapters`` on a real Postgres: the adapters' status as the admin API reads it
(the leader's count and reason, where each is desired, loaded or failing; two statements for
one adapter or a dozen holders more), and the status write that skips an adapter deleted
since the pass read it."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import event

from llmgw.store.database import create_engine, session_factory
from llmgw.store.runtime_adapters import (
    AdapterFailure,
    AdapterHolder,
    AdapterStatusRow,
    read_adapter_status,
    write_adapter_status,
)
from tests.controlplane.admin.admin_testkit import insert_node, insert_replica, sql

pytestmark = pytest.mark.timeout(60)


async def _run(db_url: str, work: Callable[[Any], Awaitable[Any]]) -> tuple[Any, int]:
    """``work(session)``'s result in one transaction, and the statements it sent."""
    engine = create_engine(db_url, pool_size=1)
    seen: list[str] = []

    def count(*args: Any) -> None:
        seen.append(str(args[2]))

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        async with session_factory(engine)() as session, session.begin():
            seen.clear()
            result = await work(session)
    finally:
        await engine.dispose()
    return result, len(seen)


def _base(db_url: str) -> None:
    sql(db_url, "INSERT INTO models (name) VALUES ('m')")
    sql(
        db_url,
        "INSERT INTO profiles (name, model_id, engine, model_path, kv_hash_seed, fingerprint, "
        "adapter_slots) SELECT 'p', id, 'sim', '/m', '7', 'fp', 4 FROM models WHERE name = 'm'",
    )
    sql(
        db_url,
        "INSERT INTO deployments (name, model_id, profile_id) SELECT 'd', m.id, p.id "
        "FROM models m JOIN profiles p ON p.model_id = m.id",
    )


def _adapter(db_url: str, name: str) -> None:
    sql(db_url, "INSERT INTO adapters (name, model, path) VALUES (%s, 'm', '/a')", (name,))


def _replica(
    db_url: str, node: str, desired: list[str], observed: list[dict[str, Any]]
) -> tuple[str, str]:
    """A one-shard replica on a new node named ``node``; returns (replica id, shard id)."""
    node_id = insert_node(db_url, node, gpus=1)
    replica = insert_replica(db_url, "d", [(node_id, [0])])
    shard = sql(db_url, "SELECT id FROM shards WHERE replica_id = %s", (replica,))[0][0]
    sql(
        db_url,
        "UPDATE shards SET desired_adapters = %s, observed_adapters = %s WHERE id = %s",
        (
            json.dumps([{"name": n, "path": "/a", "pinned": False} for n in desired]),
            json.dumps(observed),
            shard,
        ),
    )
    return str(replica), str(shard)


async def test_status_reads_the_leaders_word_and_the_shards_in_two_statements(
    db_url: str,
) -> None:
    _base(db_url)
    for n in ("sql", "chat", "idle"):
        _adapter(db_url, n)
    sql(
        db_url,
        "INSERT INTO adapter_status (adapter, desired_replicas, unplaced) VALUES "
        "('sql', 3, 'no slots free on the 2 ready replicas of model m'), ('chat', 1, '')",
    )
    r1, _ = _replica(
        db_url,
        "n1",
        ["sql", "chat"],
        [
            {"name": "chat", "state": "loaded", "reason": "", "failures": 0},
            {"name": "sql", "state": "failed", "reason": "out of memory", "failures": 3},
        ],
    )
    r2, _ = _replica(
        db_url, "n2", ["sql"], [{"name": "sql", "state": "loaded", "reason": "", "failures": 0}]
    )
    # A released shard and a replica told nothing do not count.
    _, gone = _replica(db_url, "n3", ["sql"], [{"name": "sql", "state": "loaded"}])
    sql(db_url, "UPDATE shards SET released = true WHERE id = %s", (gone,))

    status, statements = await _run(
        db_url, lambda s: read_adapter_status(s, ["sql", "chat", "idle", "unknown"])
    )
    assert statements == 2
    first, second = sorted([(r1, "n1"), (r2, "n2")])
    assert status["sql"] == AdapterStatusRow(
        desired_replicas=3,
        unplaced="no slots free on the 2 ready replicas of model m",
        replicas=(AdapterHolder(*first), AdapterHolder(*second)),
        loaded=(AdapterHolder(r2, "n2"),),
        failures=(AdapterFailure(r1, "n1", "out of memory", 3),),
    )
    assert status["chat"] == AdapterStatusRow(
        desired_replicas=1, replicas=(AdapterHolder(r1, "n1"),), loaded=(AdapterHolder(r1, "n1"),)
    )
    # Declared, never placed (or not declared at all): the empty status, desired unknown.
    assert status["idle"] == status["unknown"] == AdapterStatusRow()

    # A dozen more holders: still two statements.
    for i in range(12):
        _replica(db_url, f"x{i}", ["sql"], [])
    status, statements = await _run(db_url, lambda s: read_adapter_status(s, ["sql"]))
    assert statements == 2 and len(status["sql"].replicas) == 14


async def test_status_write_skips_an_adapter_deleted_since_the_read(db_url: str) -> None:
    _base(db_url)
    _adapter(db_url, "sql")

    async def write(session: Any) -> None:
        await write_adapter_status(session, [("sql", 2, ""), ("deleted", 1, "x")])
        await write_adapter_status(session, [("sql", 1, "min_replicas 1")])

    await _run(db_url, write)
    assert sql(db_url, "SELECT adapter, desired_replicas, unplaced FROM adapter_status") == [
        ("sql", 1, "min_replicas 1")
    ]
    # Deleted with its adapter.
    sql(db_url, "DELETE FROM adapters")
    assert sql(db_url, "SELECT count(*) FROM adapter_status") == [(0,)]
