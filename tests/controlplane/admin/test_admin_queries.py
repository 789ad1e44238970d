"""The admin API's fleet lists read a page in a constant number of statements: the same
count for one node (or replica) as for thirty, so a big fleet's `llmgw get` is not N+1."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import event

from llmgw.store import fleet as fq
from llmgw.store.database import create_engine, session_factory
from tests.controlplane.admin.admin_testkit import insert_node, insert_replica, name, sql

pytestmark = pytest.mark.timeout(60)


async def _statements(db_url: str, read: Callable[[Any], Awaitable[list[Any]]]) -> tuple[int, int]:
    """(statements issued, rows returned) by ``read(session)`` in one transaction."""
    engine = create_engine(db_url, pool_size=1)
    seen: list[str] = []

    def count(*args: Any) -> None:
        seen.append(str(args[2]))

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        async with session_factory(engine)() as session, session.begin():
            seen.clear()  # whatever the connection ran to get going is not the read's
            rows = await read(session)
    finally:
        await engine.dispose()
    return len(seen), len(rows)


def _fleet(db_url: str, nodes: int) -> None:
    sql(db_url, "INSERT INTO models (name) VALUES ('m') ON CONFLICT DO NOTHING")
    sql(
        db_url,
        "INSERT INTO profiles (name, model_id, engine, model_path, kv_hash_seed, fingerprint) "
        "SELECT 'p', id, 'sim', '/m', '7', 'fp' FROM models WHERE name = 'm' "
        "ON CONFLICT DO NOTHING",
    )
    sql(
        db_url,
        "INSERT INTO deployments (name, model_id, profile_id) SELECT 'd', m.id, p.id "
        "FROM models m JOIN profiles p ON p.model_id = m.id WHERE m.name = 'm' "
        "ON CONFLICT DO NOTHING",
    )
    for _ in range(nodes):
        node_id = insert_node(db_url, name("n"), gpus=2)
        insert_replica(db_url, "d", [(node_id, [0, 1])])


async def test_node_and_replica_pages_cost_the_same_for_1_and_30(db_url: str) -> None:
    costs = []
    for total in (1, 30):
        _fleet(db_url, total - (1 if costs else 0))
        nodes = await _statements(db_url, lambda s: fq.list_nodes(s, after=None, limit=100))
        replicas = await _statements(
            db_url, lambda s: fq.list_replicas(s, deployment="d", after=None, limit=100)
        )
        assert nodes[1] == total and replicas[1] == total
        costs.append((nodes[0], replicas[0]))
    assert costs[0] == costs[1] == (3, 3), costs
