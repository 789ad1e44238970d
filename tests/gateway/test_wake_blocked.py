"""Finding 9 (hardening-3): a wake from zero that cannot succeed (no node has the GPU class,
the engine crash-loops) answered every held request after the whole 30 s with "overloaded ...
add replicas", never the reason the leader already knew.

The route table now carries the reason (``gateway.routes.wake_blocked``, from the rollout
status and the shards the agents report failed); held requests are answered at once with 503
+ Retry-After naming it, and new ones are refused without being held."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from sqlalchemy import text

from llmgw.config import GatewaySettings
from llmgw.gateway.routes import DeclaredRow, ModelRoute, RouteTable, build_table
from llmgw.store.database import create_engine, session_factory
from llmgw.store.routes import read_declared
from tests.controlplane.agentapi.agentapi_testkit import place_shard
from tests.gateway.gateway_testkit import Key, serve_gateway
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

KEYS = {"sa": Key("ka", "tenant-a")}
AUTH = {"Authorization": "Bearer llmgw_ka_sa"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "wake up"}], "max_tokens": 4}
UNPLACEABLE = (
    "0 of 1 replicas updated, 0 ready; cannot place a replica: needs 1 GPU of class h100; "
    "node-a: no GPU of class h100"
)


def _declared(**kw: object) -> DeclaredRow:
    return DeclaredRow("m", (("m-lora", "/a"),), autoscaled=True, **kw)  # type: ignore[arg-type]


def test_the_table_reads_why_a_wake_cannot_succeed() -> None:
    table = build_table([], read_at=1.0, declared=[_declared(status_reason=UNPLACEABLE)])
    why = table.routes["m"].wake_blocked
    assert why.startswith("the leader cannot place a replica (needs 1 GPU of class h100"), why
    assert table.routes["m-lora"].wake_blocked == why  # an adapter wakes its base's replicas
    crash = build_table(
        [], read_at=1.0, declared=[_declared(crash_reason="CUDA error: no kernel image")]
    )
    assert "crash-looping (CUDA error: no kernel image)" in crash.routes["m"].wake_blocked


@pytest.mark.parametrize(
    "reason",
    [
        "",
        "complete: 0 of 0 replicas ready",
        "0 of 1 replicas updated, 0 ready",  # starting: it may yet succeed
        f"{UNPLACEABLE}; waiting for draining replicas to free their GPUs",
        f"{UNPLACEABLE}; waiting for stopping replicas to free their GPUs",
    ],
)
def test_a_wake_that_may_succeed_blocks_nothing(reason: str) -> None:
    table = build_table([], read_at=1.0, declared=[_declared(status_reason=reason)])
    assert table.routes["m"].wake_blocked == ""


def _route(blocked: str = "") -> RouteTable:
    return RouteTable(
        {"m": ModelRoute("m", "m", None, (), wakeable=True, wake_blocked=blocked)}, 1.0
    )


def test_held_requests_are_answered_with_the_reason_once_the_leader_knows_it() -> None:
    settings = GatewaySettings(queue_timeout_s=30)
    with serve_gateway(_route(), KEYS, settings=settings) as gw:  # type: ignore[arg-type]
        flow = gw.gateway.flow

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=40) as http:
                held = [
                    asyncio.create_task(http.post("/v1/chat/completions", json=CHAT))
                    for _ in range(3)
                ]
                await asyncio.to_thread(
                    wait_for, lambda: flow.demand["m"].held == 3, timeout_s=10, what="3 held"
                )
                gw.gateway.routes.table = _route("the leader cannot place a replica (no h100)")  # type: ignore[attr-defined]
                return await asyncio.gather(*held)

        started = time.monotonic()
        answers = asyncio.run(scenario())
        assert time.monotonic() - started < 10  # not the 30 s wait
        for r in answers:
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "30"
            assert "cannot place a replica (no h100)" in r.json()["error"]["message"], r.text
        # A new request is refused at once, not held.
        started = time.monotonic()
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=10)
        assert r.status_code == 503 and "no h100" in r.text
        assert time.monotonic() - started < 2
        assert 'reason="wake_blocked"' in gw.metrics_text()


async def test_the_route_statement_reads_the_leaders_reasons(db_url: str) -> None:
    """``store.routes.read_declared`` against Postgres: the rollout status line and the newest
    reason a shard of the deployment was reported failed with."""
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        async with sessions() as session, session.begin():
            node = await session.execute(
                text("INSERT INTO nodes (name) VALUES ('n1') RETURNING id")
            )
            node_id = str(node.scalar_one())
        shard = await place_shard(sessions, node_id, gpus=(0,), model="delta")
        async with sessions() as session, session.begin():
            await session.execute(
                text(
                    "INSERT INTO deployment_status (deployment_id, reason) SELECT id, :r "
                    "FROM deployments WHERE name = 'delta'"
                ),
                {"r": UNPLACEABLE},
            )
        async with sessions() as session, session.begin():
            (row,) = [d for d in await read_declared(session) if d.name == "delta"]
        assert row.status_reason == UNPLACEABLE and row.crash_reason is None
        async with sessions() as session, session.begin():
            await session.execute(
                text(
                    "UPDATE shards SET observed_state = 'failed', observed_reason = 'OOM' "
                    "WHERE id = :id"
                ),
                {"id": shard},
            )
            (row,) = [d for d in await read_declared(session) if d.name == "delta"]
        assert row.crash_reason == "OOM"
    finally:
        await engine.dispose()
