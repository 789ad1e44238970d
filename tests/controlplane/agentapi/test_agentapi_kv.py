"""The KV-delta endpoint over real HTTP: authentication from memory, the placed map from the
database (never a query per request), and the intake's answers (docs/architecture.md §5)."""

from __future__ import annotations

import asyncio
import time
from array import array

import pytest

from llmgw.config import AgentApiSettings
from llmgw.protocol.kvstream import (
    KV_CONTENT_TYPE,
    KV_PATH,
    KvDeltaRequest,
    decode_kv_response,
    encode_kv_request,
)
from tests.controlplane.agentapi.agentapi_testkit import (
    FAST,
    Node,
    fetch,
    make_token,
    place_shard,
    running_agent_api,
)

pytestmark = pytest.mark.timeout(60)


def _reset(shard: str, hashes: list[int], *, version: int = 1, block_size: int = 16) -> bytes:
    return encode_kv_request(
        KvDeltaRequest(
            shard_id=shard,
            base_version=0,
            new_version=version,
            reset=True,
            block_size=block_size,
            added={"GPU": array("Q", hashes)},
        )
    )


def _delta(shard: str, base: int, new: int, added: list[int]) -> bytes:
    return encode_kv_request(
        KvDeltaRequest(
            shard_id=shard,
            base_version=base,
            new_version=new,
            block_size=16,
            added={"GPU": array("Q", added)},
        )
    )


async def _post(cp: object, node: Node | None, body: bytes, **headers: str) -> tuple[int, str]:
    h = {"Content-Type": KV_CONTENT_TYPE, **(node.auth if node else {}), **headers}
    r = await cp.client.post(KV_PATH, content=body, headers=h)  # type: ignore[attr-defined]
    if r.status_code != 200:
        return r.status_code, r.json()["code"]
    return 200, decode_kv_response(r.content)


async def test_kv_deltas_reach_the_index_for_the_nodes_own_shards(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions)
        a, b = await cp.node(token, "a"), await cp.node(token, "b")
        shard = await place_shard(cp.sessions, a.id, kv_events=True, model="llama")
        # A node this instance has not seen yet (registered, never synced here, no refresh
        # since) is refused on the KV path, which never queries; the miss schedules a refresh.
        assert await _post(cp, a, _reset(shard, [1, 2, 3])) == (401, "unauthorized")
        await cp.sync(a, seq=1)
        # A shard not placed as far as this instance knows: retry, not an error.
        cp.api.placed.placed = {}
        assert await _post(cp, a, _reset(shard, [1, 2, 3])) == (200, "retry")
        await cp.sync(a, seq=2)  # a sync that reads the desired set updates the map at once
        assert await _post(cp, a, _reset(shard, [1, 2, 3])) == (200, "ack")
        assert cp.api.intake.version(shard) == 1
        assert cp.api.intake.index.shards("llama") == [shard]
        assert cp.api.intake.index.num_blocks(shard) == 3
        assert await _post(cp, a, _delta(shard, 1, 2, [4])) == (200, "ack")
        assert cp.api.intake.index.num_blocks(shard) == 4
        assert await _post(cp, a, _delta(shard, 7, 8, [5])) == (200, "need_full")
        # Another node's report on a's shard is not applied.
        await cp.sync(b, seq=1)
        assert await _post(cp, b, _reset(shard, [9])) == (200, "retry")
        assert cp.api.intake.counts["foreign_node"] == 1
        assert cp.api.intake.index.num_blocks(shard) == 4
        # A view hashed with another block size than the profile's is refused.
        assert await _post(cp, a, _reset(shard, [1], version=9, block_size=32)) == (200, "retry")
        assert cp.metric("llmgw_agent_kv_requests_total", {"result": "ack"}) == 2


async def test_kv_requests_are_authenticated_and_bounded(db_url: str) -> None:
    settings = AgentApiSettings(
        kv_max_body_bytes=64 << 10, kv_full_copy_rate_per_s=0.01, kv_full_copy_burst=1
    )
    async with running_agent_api(db_url, settings=settings) as cp:
        node = await cp.node(await make_token(cp.sessions), "a")
        shard = await place_shard(cp.sessions, node.id, kv_events=True)
        await cp.sync(node, seq=1)
        wrong = Node(node.id, node.credential[:-3] + "xyz", "a")
        assert await _post(cp, wrong, _reset(shard, [1])) == (401, "unauthorized")
        assert await _post(cp, None, _reset(shard, [1])) == (401, "unauthorized")
        # Refused on the header: a body far over the cap is never read.
        big = b"\0" * (1 << 20)
        assert await _post(cp, wrong, big) == (401, "unauthorized")
        assert await _post(cp, node, big) == (413, "body-too-large")
        assert await _post(cp, node, b"\xc1garbage") == (400, "malformed-json")
        assert await _post(cp, node, _reset(shard, [1])) == (200, "ack")
        # The second full copy in a row is throttled, with a Retry-After to wait.
        r = await cp.client.post(
            KV_PATH, content=_reset(shard, [1, 2], version=2), headers=node.auth
        )
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["code"] == "too-many-requests"
        # Deltas are not throttled.
        assert await _post(cp, node, _delta(shard, 1, 2, [7])) == (200, "ack")


async def test_a_second_instance_learns_nodes_and_shards_without_their_syncs(
    db_url: str,
) -> None:
    async with running_agent_api(db_url, instance_id="cp-1") as one:
        node = await one.node(await make_token(one.sessions), "a")
        shard = await place_shard(one.sessions, node.id, kv_events=True)
        async with running_agent_api(db_url, instance_id="cp-2", settings=FAST) as two:
            # The node registered and syncs with cp-1 only; cp-2 picks both up by refresh.
            deadline = time.monotonic() + 10
            while await _post(two, node, _reset(shard, [1])) != (200, "ack"):
                assert time.monotonic() < deadline, "cp-2 never accepted the node's KV deltas"
                await asyncio.sleep(0.1)
            # Both instances are live and listed to agents.
            seq = 1
            resp = await one.sync(node, seq=seq)
            deadline = time.monotonic() + 10
            while {i.id for i in resp.instances} != {"cp-1", "cp-2"}:
                assert time.monotonic() < deadline, resp.instances
                await asyncio.sleep(0.1)
                seq += 1
                resp = await one.sync(node, seq=seq)
            urls = {i.id: i.internal_url for i in resp.instances}
            assert urls["cp-2"] == two.base_url
        # A clean shutdown removes cp-2's row: agents stop feeding it at once.
        rows = await fetch(one.sessions, "SELECT id FROM controlplane_instances")
        assert [r.id for r in rows] == ["cp-1"]
