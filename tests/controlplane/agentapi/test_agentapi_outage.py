"""The agent API while Postgres refuses connections: unchanged syncs are still answered (from
the node table in memory) and their heartbeats kept for later; syncs that must write are
answered 503 with a ProtocolErrorBody, never a 500 (the agent backs off and keeps its engines)."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmgw.config import AgentApiSettings
from llmgw.protocol.sync import REGISTER_PATH, ShardBinding
from tests.controlplane.agentapi.agentapi_testkit import (
    fetch,
    make_token,
    place_shard,
    running_agent_api,
)
from tests.pg_harness import PgServer

pytestmark = pytest.mark.timeout(60)


async def test_unchanged_syncs_survive_a_database_outage(db_url: str, pg_server: PgServer) -> None:
    settings = AgentApiSettings(node_refresh_s=0.3, heartbeat_flush_s=0.2)
    async with running_agent_api(db_url, settings=settings) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        shard = await place_shard(cp.sessions, node.id)
        ready = [ShardBinding(shard_id=shard, observed_state="ready", pid=5)]
        assert (await cp.sync(node, seq=1, bindings=ready)).desired_version == "1"
        pg_server.allow_connections(db_url, False)
        try:
            resp = await cp.sync(node, seq=2, desired_version="1", bindings=ready)
            assert resp.unchanged
            failed = [ShardBinding(shard_id=shard, observed_state="failed", reason="x")]
            r = await cp.sync_raw(node, seq=3, desired_version="1", bindings=failed)
            assert r.status_code == 503
            assert r.json()["code"] == "database-unavailable"
            assert cp.api.heartbeats.num_pending == 1
        finally:
            pg_server.allow_connections(db_url, True)
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
    pg_server.allow_connections(db_url, False)
    try:
        async with running_agent_api(db_url) as cp:
            r = await cp.client.post(REGISTER_PATH, content=b"{}")
            assert r.status_code == 503 and r.json()["code"] == "database-unavailable"
            pg_server.allow_connections(db_url, True)
            token = await make_token(cp.sessions)
            deadline = time.monotonic() + 15
            while (await cp.client.post(REGISTER_PATH, content=b"{}")).status_code == 503:
                assert time.monotonic() < deadline, "the agent API never came up"
                await asyncio.sleep(0.1)
            node = await cp.node(token, "late")
            assert (await cp.sync(node, seq=1)).desired_version == "0"
    finally:
        pg_server.allow_connections(db_url, True)
