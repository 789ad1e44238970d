"""Runtime adapters on the agent protocol, over real HTTP against a real Postgres (issue [lora]):
a rank-0 shard's desired set carries the adapters the leader placed, a change of them moves
the sync's desired_version and never the shard's digest or fingerprint (no engine restarts),
and the adapters an agent reports are stored on its own shards, rewritten only when they
change (the route table re-reads on that column)."""

from __future__ import annotations

import json
import uuid

import pytest

from llmgw.nodeagent.prepare import launch_digest
from llmgw.protocol.sync import AdapterObserved, RuntimeAdapter, ShardBinding
from llmgw.store.agent_shards import apply_observed_adapters
from llmgw.store.runtime_adapters import write_desired_adapters
from tests.controlplane.agentapi.agentapi_testkit import (
    fetch,
    make_token,
    place_shard,
    running_agent_api,
)

pytestmark = pytest.mark.timeout(60)


def _binding(shard: str, *adapters: AdapterObserved) -> ShardBinding:
    return ShardBinding.model_validate(
        {
            "shard_id": shard,
            "observed_state": "ready",
            "http_port": 20001,
            "pid": 4242,
            "adapters": [a.model_dump() for a in adapters],
        }
    )


_SQL = AdapterObserved(name="sql", state="loaded")
_CHAT_FAILED = AdapterObserved(name="chat", state="failed", reason="no such directory", failures=2)


async def test_desired_adapters_move_the_etag_and_never_the_digest(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        shard = await place_shard(cp.sessions, node.id, model="llama")
        first = await cp.sync(node, seq=1)
        assert first.shards is not None and first.shards[0].adapters == ()
        before = first.shards[0]
        version = first.desired_version
        assert (await cp.sync(node, seq=2, desired_version=version)).unchanged

        # The leader places two adapters on the shard's engine.
        placed = [
            {"name": "sql", "path": "/adapters/sql", "pinned": False},
            {"name": "chat", "path": "https://hub.example/chat.tar", "pinned": True},
        ]
        async with cp.sessions() as session, session.begin():
            bumped = await write_desired_adapters(session, [(uuid.UUID(shard), placed)])
        assert bumped == [uuid.UUID(node.id)]
        changed = await cp.sync(node, seq=3, desired_version=version)
        assert not changed.unchanged and changed.desired_version == str(int(version or 0) + 1)
        assert changed.shards is not None
        after = changed.shards[0]
        assert after.adapters == (
            RuntimeAdapter(name="sql", path="/adapters/sql"),
            RuntimeAdapter(name="chat", path="https://hub.example/chat.tar", pinned=True),
        )
        # Loaded at runtime: the spec, its digest (what the agent restarts an engine on) and
        # the fingerprint are the ones before.
        assert after.spec == before.spec and after.fingerprint == before.fingerprint
        assert launch_digest(after) == launch_digest(before)

        # The same list again changes nothing: no bump, the agent's set stays current.
        async with cp.sessions() as session, session.begin():
            assert await write_desired_adapters(session, [(uuid.UUID(shard), placed)]) == []
        again = await cp.sync(node, seq=4, desired_version=changed.desired_version)
        assert again.unchanged


async def test_reported_adapters_are_stored_on_own_shards_only_when_they_change(
    db_url: str,
) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions)
        node = await cp.node(token, "n1")
        other = await cp.node(token, "n2")
        shard = await place_shard(cp.sessions, node.id)
        version = (await cp.sync(node, seq=1)).desired_version
        await cp.sync(
            node, seq=2, desired_version=version, bindings=[_binding(shard, _SQL, _CHAT_FAILED)]
        )

        async def stored() -> list[dict[str, object]]:
            rows = await fetch(
                cp.sessions, "SELECT observed_adapters FROM shards WHERE id = :id", id=shard
            )
            value = rows[0][0]
            return list(value if isinstance(value, list) else json.loads(value))

        # In name order, whatever order the agent sent.
        assert await stored() == [
            {"name": "chat", "state": "failed", "reason": "no such directory", "failures": 2},
            {"name": "sql", "state": "loaded", "reason": "", "failures": 0},
        ]

        sid = uuid.UUID(shard)
        async with cp.sessions() as session, session.begin():
            # The same set, in another order: not a change, the row is not rewritten.
            same = await apply_observed_adapters(
                session, uuid.UUID(node.id), [(sid, _binding(shard, _CHAT_FAILED, _SQL))]
            )
            assert same == set()
            loaded = AdapterObserved(name="chat", state="loaded")
            moved = await apply_observed_adapters(
                session, uuid.UUID(node.id), [(sid, _binding(shard, _SQL, loaded))]
            )
            assert moved == {sid}
            # Another node's report on this shard writes nothing.
            foreign = await apply_observed_adapters(
                session, uuid.UUID(other.id), [(sid, _binding(shard))]
            )
            assert foreign == set()
        assert [a["state"] for a in await stored()] == ["loaded", "loaded"]

        # Through the sync: the engine lost its adapters (a restart); the empty list is stored.
        await cp.sync(node, seq=3, desired_version=version, bindings=[_binding(shard)])
        assert await stored() == []
