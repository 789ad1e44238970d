"""The agent API while Postgres refuses connections: unchanged syncs are still answered (from
the node table in memory) and their heartbeats kept for later; syncs that must write are
answered 503 with a ProtocolErrorBody, never a 500 (the agent backs off and keeps its engines)."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest
from agentapi_testkit import fetch, make_token, place_shard, running_agent_api
from pg_harness import PgServer

from llmgw.config import AgentApiSettings
from llmgw.embedded_postgres import libpq_url
from llmgw.protocol.sync import REGISTER_PATH, ShardBinding

pytestmark = pytest.mark.timeout(60)


def _connections(pg: PgServer, db_url: str, *, allowed: bool) -> None:
    name = db_url.rsplit("/", 1)[1].split("?", 1)[0]
    with psycopg.connect(libpq_url(pg.admin_url), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {str(allowed).lower()}')
        if not allowed:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )


async def test_unchanged_syncs_survive_a_database_outage(db_url: str, pg_server: PgServer) -> None:
    settings = AgentApiSettings(node_refresh_s=0.3, heartbeat_flush_s=0.2)
    async with running_agent_api(db_url, settings=settings) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        shard = await place_shard(cp.sessions, node.id)
        ready = [ShardBinding(shard_id=shard, observed_state="ready", pid=5)]
        assert (await cp.sync(node, seq=1, bindings=ready)).desired_version == "1"
        _connections(pg_server, db_url, allowed=False)
        try:
            resp = await cp.sync(node, seq=2, desired_version="1", bindings=ready)
            assert resp.unchanged
            failed = [ShardBinding(shard_id=shard, observed_state="failed", reason="x")]
            r = await cp.sync_raw(node, seq=3, desired_version="1", bindings=failed)
            assert r.status_code == 503
            assert r.json()["code"] == "database-unavailable"
            assert cp.api.heartbeats.num_pending == 1
        finally:
            _connections(pg_server, db_url, allowed=True)
        # Back: the kept heartbeat lands, and the report that could not be written is.
        await cp.api.heartbeats.flush()
        status = await fetch(cp.sessions, "SELECT agent_seq FROM node_status")
        assert status[0].agent_seq == 2
        r = await cp.sync_raw(node, seq=4, desired_version="1", bindings=failed)
        assert r.status_code == 200
        rows = await fetch(cp.sessions, "SELECT observed_state FROM shards")
        assert rows[0].observed_state == "failed"


async def test_the_api_starts_without_a_database_and_serves_once_it_is_back(
    db_url: str, pg_server: PgServer
) -> None:
    _connections(pg_server, db_url, allowed=False)
    try:
        async with running_agent_api(db_url) as cp:
            r = await cp.client.post(REGISTER_PATH, content=b"{}")
            assert r.status_code == 503 and r.json()["code"] == "database-unavailable"
            _connections(pg_server, db_url, allowed=True)
            token = await make_token(cp.sessions)
            deadline = time.monotonic() + 15
            while (await cp.client.post(REGISTER_PATH, content=b"{}")).status_code == 503:
                assert time.monotonic() < deadline, "the agent API never came up"
                await asyncio.sleep(0.1)
            node = await cp.node(token, "late")
            assert (await cp.sync(node, seq=1)).desired_version == "0"
    finally:
        _connections(pg_server, db_url, allowed=True)
