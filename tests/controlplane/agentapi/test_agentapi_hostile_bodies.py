"""Hostile requests to the agent API over real HTTP against a real Postgres: JSON nested past
the bound, NaN, lone surrogates (all a 400 ``malformed-json`` ProtocolErrorBody, never a 500),
and forged node ids, whose repeats must not each cost a transaction.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from llmgw.controlplane.agentapi.nodes import UNKNOWN_TTL_S
from llmgw.protocol.sync import REGISTER_PATH, SYNC_PATH, ProtocolErrorBody
from tests.controlplane.agentapi.agentapi_testkit import (
    FAST,
    AgentApiServer,
    Node,
    fetch,
    make_token,
    running_agent_api,
)

pytestmark = pytest.mark.timeout(60)


def _nested(depth: int) -> bytes:
    """The issue's body: one key holding `depth` nested lists (built as text: json.dumps
    would recurse)."""
    return b'{"x": ' + b"[" * depth + b"]" * depth + b"}"


def _refusal(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text[:500]
    body = ProtocolErrorBody.model_validate_json(r.content)
    assert body.code == code
    return body.message


async def test_deep_nan_and_lone_surrogate_bodies_are_a_400_on_register_and_sync(
    db_url: str,
) -> None:
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1")
        sync_ok = (
            f'{{"protocol_version":1,"node_id":"{node.id}","agent_epoch":1,"seq":1,'
            '"bindings":[{"shard_id":"s1","observed_state":"ready","started_at":1.5}]}'
        )
        hostile: dict[str, tuple[bytes, str]] = {
            "970 levels": (_nested(970), "more than 64 levels"),
            "100k levels": (_nested(100_000), "more than 64 levels"),
            "NaN": (sync_ok.replace("1.5", "NaN").encode(), "NaN is not valid JSON"),
            "-Infinity": (sync_ok.replace("1.5", "-Infinity").encode(), "Infinity is not"),
            "lone surrogate": (
                sync_ok.replace('"s1"', '"\\ud800"').encode(),
                "lone UTF-16 surrogate (\\ud800)",
            ),
        }
        for why, (body, words) in hostile.items():
            # Registration carries no credential: anyone on the network reaches its parser.
            r = await cp.client.post(REGISTER_PATH, content=body)
            assert words in _refusal(r, 400, "malformed-json"), why
            r = await cp.client.post(SYNC_PATH, content=body, headers=node.auth)
            assert words in _refusal(r, 400, "malformed-json"), why
        # The same words inside strings are text, and the node still syncs.
        text = sync_ok.replace('"s1"', '"NaN Infinity [[[ \\\\ud800 \\ud83d\\ude00"')
        r = await cp.client.post(SYNC_PATH, content=text.encode(), headers=node.auth)
        assert r.status_code == 200, r.text


@contextmanager
def _node_reads(cp: AgentApiServer) -> Iterator[list[str]]:
    """Every statement that reads one node's row (``read_sync_node``), as it is sent."""
    seen: list[str] = []
    engine = cp.sessions.kw["bind"].sync_engine

    def before(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "WHERE n.id =" in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before)


def _forged(node_id: uuid.UUID) -> Node:
    return Node(str(node_id), f"llmgwn_{node_id}_{'A' * 43}", "forged")


async def test_repeated_syncs_of_an_unknown_node_cost_one_query(db_url: str) -> None:
    async with running_agent_api(db_url) as cp:
        forged = _forged(uuid.uuid4())
        with _node_reads(cp) as reads:
            for seq in range(20):
                r = await cp.sync_raw(forged, seq=seq + 1)
                _refusal(r, 401, "unauthorized")
        assert len(reads) == 1, f"{len(reads)} reads of one unknown node's row"


async def test_a_node_registered_through_this_instance_is_not_refused_as_unknown(
    db_url: str,
) -> None:
    """The one way an id read as unknown comes to register: an admin creates the row after a
    sync naming its id was refused, and the agent claims it."""
    async with running_agent_api(db_url) as cp:
        node_id = uuid.uuid4()
        _refusal(await cp.sync_raw(_forged(node_id), seq=1), 401, "unauthorized")
        await fetch(
            cp.sessions,
            "INSERT INTO nodes (id, name, approval_state) VALUES (:id, 'pre', 'approved') "
            "RETURNING id",
            id=node_id,
        )
        node = await cp.node(await make_token(cp.sessions), "pre")
        assert node.id == str(node_id)
        assert (await cp.sync(node, seq=1)).approval_state == "approved"


async def test_a_node_registered_through_another_instance_is_refused_at_most_the_ttl(
    db_url: str,
) -> None:
    async with (
        running_agent_api(db_url, instance_id="cp-a") as a,
        running_agent_api(db_url, instance_id="cp-b") as b,
    ):
        node_id = uuid.uuid4()
        _refusal(await b.sync_raw(_forged(node_id), seq=1), 401, "unauthorized")
        await fetch(
            a.sessions,
            "INSERT INTO nodes (id, name, approval_state) VALUES (:id, 'pre', 'approved') "
            "RETURNING id",
            id=node_id,
        )
        node = await a.node(await make_token(a.sessions), "pre")
        registered = time.monotonic()
        deadline = registered + UNKNOWN_TTL_S + 5
        seq = 1
        while (r := await b.sync_raw(node, seq=seq)).status_code != 200:
            _refusal(r, 401, "unauthorized")
            assert time.monotonic() < deadline, "instance b still refuses the registered node"
            seq += 1
            await asyncio.sleep(0.05)
        assert time.monotonic() - registered <= UNKNOWN_TTL_S + 1


async def test_a_flood_of_distinct_unknown_ids_is_rationed_without_a_query(db_url: str) -> None:
    settings = FAST.model_copy(update={"unknown_node_rate_per_s": 0.01, "unknown_node_burst": 6})
    async with running_agent_api(db_url, settings=settings) as cp:
        node = await cp.node(await make_token(cp.sessions), "real")
        await cp.sync(node, seq=1)  # its first sync reads its row: one of the bucket's six
        with _node_reads(cp) as reads:
            for seq in range(5):
                _refusal(await cp.sync_raw(_forged(uuid.uuid4()), seq=seq + 1), 401, "unauthorized")
            assert len(reads) == 5
            for seq in range(20):
                r = await cp.sync_raw(_forged(uuid.uuid4()), seq=seq + 1)
                assert "unknown_node_rate_per_s" in _refusal(r, 429, "too-many-requests")
                assert int(r.headers["Retry-After"]) >= 1
            assert len(reads) == 5, "a sync past the bucket read its node's row"
            # A node the table holds never waits on the bucket (sync asserts a 200).
            await cp.sync(node, seq=2)
        throttled = {"endpoint": "sync", "reason": "lookups_throttled"}
        assert cp.metric("llmgw_agent_auth_failures_total", throttled) == 20
