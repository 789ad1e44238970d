"""gateway_demand against a real Postgres: one batched write per gateway, sums over fresh
rows only, a saturation that keeps its start across writes and ends when the queue does,
and the status screen's saturated model."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text

from llmgw.commands.status import render
from llmgw.controlplane.store.database import create_engine, session_factory
from llmgw.controlplane.store.demand import DemandRow, read_demand, write_demand
from llmgw.controlplane.store.tables import GatewayDemand

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
    assert any(line.split()[:5] == ["m", "saturated", "50", "16", "3"] for line in lines)
    assert any(line.split()[:2] == ["n", "ok"] for line in lines)
