"""Unchanged syncs write nothing but the batched heartbeat (docs/architecture.md §5).

Writes are counted two ways: exactly, by row triggers this test adds to its throwaway
database (which transaction touched which table), and as the statistics collector sees them
(pg_stat_user_tables.n_tup_upd), read after the server's connections are gone so every
backend has flushed its counters.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from sqlalchemy import text

from llmgw.config import AgentApiSettings
from llmgw.protocol.sync import ShardBinding
from llmgw.store.database import create_engine, session_factory
from tests.controlplane.agentapi.agentapi_testkit import (
    fetch,
    make_token,
    place_shard,
    running_agent_api,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

_TRIGGERS = (
    "CREATE TABLE test_write_log (id bigserial PRIMARY KEY, tbl text, xid bigint, node uuid)",
    "CREATE FUNCTION test_log_write() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "INSERT INTO test_write_log (tbl, xid, node) VALUES (TG_TABLE_NAME, txid_current(), "
    "coalesce(to_jsonb(NEW) ->> 'node_id', to_jsonb(NEW) ->> 'id')::uuid); RETURN NULL; END $$",
    *(
        f"CREATE TRIGGER test_log_{t} AFTER INSERT OR UPDATE ON {t} "
        "FOR EACH ROW EXECUTE FUNCTION test_log_write()"
        for t in ("nodes", "node_status", "shards")
    ),
)

_STATS = (
    "SELECT relname, n_tup_upd + n_tup_ins + n_tup_del AS writes FROM pg_stat_user_tables "
    "WHERE relname IN ('nodes', 'node_status', 'shards', 'gpu_assignments')"
)


async def _sql(db_url: str, statements: tuple[str, ...] | list[str]) -> list[tuple[object, ...]]:
    engine = create_engine(db_url, pool_size=1)
    try:
        async with session_factory(engine)() as session, session.begin():
            out: list[tuple[object, ...]] = []
            for s in statements:
                result = await session.execute(text(s))
                if result.returns_rows:
                    out.extend(tuple(r) for r in result)
            return out
    finally:
        await engine.dispose()


async def test_unchanged_syncs_write_only_the_batched_heartbeat(db_url: str) -> None:
    await _sql(db_url, _TRIGGERS)
    period_s = 0.5
    settings = AgentApiSettings(heartbeat_flush_s=period_s, placed_refresh_s=30)
    async with running_agent_api(db_url, settings=settings) as cp:
        token = await make_token(cp.sessions)
        nodes = [await cp.node(token, f"n{i}") for i in range(3)]
        shards = [await place_shard(cp.sessions, n.id) for n in nodes]
        bindings = {
            n.id: [ShardBinding(shard_id=s, observed_state="ready", pid=100 + i)]
            for i, (n, s) in enumerate(zip(nodes, shards, strict=True))
        }
        for n in nodes:  # the first sync of each: changed (bindings applied, set sent)
            resp = await cp.sync(n, seq=1, bindings=bindings[n.id])
            assert not resp.unchanged and resp.desired_version == "1"
        await cp.api.heartbeats.flush()
        mark = (await fetch(cp.sessions, "SELECT coalesce(max(id), 0) FROM test_write_log"))[0][0]

        rounds = 12
        started = time.monotonic()
        for seq in range(2, 2 + rounds):
            got = await asyncio.gather(
                *(cp.sync(n, seq=seq, desired_version="1", bindings=bindings[n.id]) for n in nodes)
            )
            assert all(r.unchanged and r.shards is None for r in got)
            await asyncio.sleep(0.05)
        await cp.api.heartbeats.flush()
        elapsed = time.monotonic() - started
        assert cp.metric("llmgw_agent_syncs_total", {"result": "unchanged"}) == 3 * rounds

        log = await fetch(
            cp.sessions, "SELECT tbl, xid, node FROM test_write_log WHERE id > :m", m=mark
        )
        # Nothing but node_status, and there only heartbeat flushes: one row per node per
        # flush, one flush per period (plus the one forced above).
        assert {r.tbl for r in log} <= {"node_status"}, log
        per_flush = Counter(r.xid for r in log)
        per_node_flush = Counter((r.xid, r.node) for r in log)
        assert max(per_node_flush.values()) == 1
        assert len(per_flush) <= elapsed / period_s + 2, (len(per_flush), elapsed)
        assert 3 * rounds > len(log)  # batched: far fewer rows than syncs
        status = await fetch(cp.sessions, "SELECT agent_seq, last_sync_at FROM node_status")
        assert {r.agent_seq for r in status} == {1 + rounds}
        changed_writes = len(
            await fetch(cp.sessions, "SELECT 1 FROM test_write_log WHERE id <= :m", m=mark)
        )

    # The statistics collector agrees once every server connection is gone (a backend
    # flushes its counters when it exits).
    def backends_gone() -> bool:
        rows = asyncio.run(
            _sql(
                db_url,
                [
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = 'llmgw-controlplane' AND pid <> pg_backend_pid()"
                ],
            )
        )
        return rows[0][0] == 0

    await asyncio.to_thread(wait_for, backends_gone, timeout_s=10, what="server backends exit")
    stats = dict(await _sql(db_url, [_STATS]))
    # Exactly what the triggers saw: registration (3 nodes, 3 status rows), the placements
    # (3 shards, 3 GPU rows, 3 desired_version bumps), the first syncs (3 status rows, 3
    # bindings), then nothing but the heartbeat rows.
    assert changed_writes == 3 + 3 + 3 + 3 + 3 + 3
    assert stats == {
        "nodes": 3 + 3,
        "node_status": 3 + 3 + len(log),
        "shards": 3 + 3,
        "gpu_assignments": 3,
    }, (stats, len(log))
