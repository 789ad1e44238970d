"""gateway_demand against a real Postgres: one batched write per gateway, sums over fresh
rows only, a saturation that keeps its start across writes and ends when the queue does,
and the status screen's saturated model."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text

from llmgw.commands.status import render
from llmgw.store.database import create_engine, session_factory
from llmgw.store.demand import DemandRow, read_demand, write_demand
from llmgw.store.tables import GatewayDemand

pytestmark = pytest.mark.timeout(60)


async def test_demand_sums_fresh_rows_and_keeps_the_saturation_start(db_url: str) -> None:
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        async with sessions() as s, s.begin():
            await write_demand(
                s, "cp1", [DemandRow("m", 40, 8, 3, 5.0), DemandRow("n", 0, 2, 0, None)]
            )
            await write_demand(s, "cp2", [DemandRow("m", 10, 8, 0, 1.0)])
            await write_demand(s, "old", [DemandRow("m", 999, 0, 0, 99.0)])
            await s.execute(
                text("UPDATE gateway_demand SET updated_at = now() - interval '1 min' "
                     "WHERE instance_id = 'old'")
            )  # fmt: skip
        async with sessions() as s, s.begin():
            rows = {r.model: r for r in await read_demand(s, fresh_s=10)}
            first = rows["m"].saturated_since
            assert (rows["m"].queued, rows["m"].in_flight, rows["m"].shed) == (50, 16, 3)
            assert rows["m"].gateways == 2 and first is not None
            assert rows["n"].saturated_since is None
            # A later write of a still-saturated model keeps when it began.
            await write_demand(s, "cp1", [DemandRow("m", 41, 8, 3, 0.0)])
            await write_demand(s, "cp2", [DemandRow("m", 0, 8, 0, None)])
        async with sessions() as s, s.begin():
            m = next(r for r in await read_demand(s, fresh_s=10) if r.model == "m")
            assert m.saturated_since == first and m.queued == 41
            assert await s.scalar(select(func.count()).select_from(GatewayDemand)) == 4
    finally:
        await engine.dispose()


def test_status_shows_a_saturated_model() -> None:
    screen = render(
        {
            "nodes": [],
            "deployments": [],
            "shards": [],
            "prefix_routing": {},
            "demand": [
                {"model": "m", "saturated": True, "queued": 50, "in_flight": 16, "shed": 3,
                 "saturated_since": "2026-12-02T02:00:00+00:00"},
                {"model": "n", "saturated": False, "queued": 0, "in_flight": 2, "shed": 0,
                 "saturated_since": None},
            ],
        }
    )  # fmt: skip
    lines = screen.splitlines()
    assert "GATEWAY DEMAND" in screen
    # MODEL STATE QUEUED HELD IN-FLIGHT PREFILL UNCACHED SHED
    want = ["m", "saturated", "50", "0", "16", "0", "0", "3"]
    assert any(line.split()[:8] == want for line in lines)
    assert any(line.split()[:2] == ["n", "ok"] for line in lines)


async def test_autoscale_fields_sum_or_take_the_largest_stale_rows_go_and_notify_wakes(
    db_url: str,
) -> None:
    import psycopg

    from llmgw.embedded_postgres import libpq_url
    from llmgw.store.demand import DEMAND_CHANNEL

    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    listener = await psycopg.AsyncConnection.connect(libpq_url(db_url), autocommit=True)
    try:
        await listener.execute(f"LISTEN {DEMAND_CHANNEL}")
        async with sessions() as s, s.begin():
            row = DemandRow("a", 3, 0, 0, 1.0, queued_prefill_tokens=900,
                            uncached_prefill_tokens=600, held=3, engine_waiting=2, hit_rate=0.5)  # fmt: skip
            await write_demand(s, "gw1", [row])
            await write_demand(
                s,
                "gw2",
                [
                    DemandRow(
                        "a",
                        1,
                        0,
                        0,
                        1.0,
                        queued_prefill_tokens=100,
                        uncached_prefill_tokens=100,
                        held=1,
                        engine_waiting=5,
                        hit_rate=0.0,
                    )
                ],
            )
            await write_demand(s, "gone", [DemandRow("a", 0, 0, 0, None)])
            await s.execute(
                text("UPDATE gateway_demand SET updated_at = now() - interval '2 hours' "
                     "WHERE instance_id = 'gone'")
            )  # fmt: skip
        async with sessions() as s, s.begin():
            (a,) = [r for r in await read_demand(s, fresh_s=10) if r.model == "a"]
            assert (a.queued_prefill_tokens, a.uncached_prefill_tokens, a.held) == (1000, 700, 4)
            assert a.engine_waiting == 5  # the largest view: every gateway scrapes the same engines
            assert a.hit_rate == pytest.approx(0.25)
            # The next write of any instance deletes rows older than an hour of the others.
            await write_demand(s, "gw1", [row], notify=True)
        async with sessions() as s:
            instances = set((await s.execute(select(GatewayDemand.instance_id))).scalars().all())
        assert instances == {"gw1", "gw2"}
        notifies = listener.notifies(timeout=5, stop_after=1)
        got = [n.channel async for n in notifies]
        assert got == [DEMAND_CHANNEL]
    finally:
        await listener.close()
        await engine.dispose()
