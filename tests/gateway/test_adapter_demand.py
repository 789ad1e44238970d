"""What a gateway reports of adapter requests (issue [lora]): each adapter's own row in
``gateway_demand`` (its queued, held and in flight requests, not its replicas'), its base
model's row counting them too (the base's autoscaler sees all load), every name's request rate
(``requests_per_s``), and the leader woken (NOTIFY) while a request is held for an adapter
loaded nowhere. Flow control runs on a fake clock; the rows go through the real reporter to a
real Postgres and back through ``read_demand``."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from llmgw.config import GatewaySettings
from llmgw.embedded_postgres import libpq_url
from llmgw.gateway.demand import DemandReporter
from llmgw.gateway.flow import FlowControl
from llmgw.gateway.load import LoadTracker
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routes import AdapterRow, DeclaredRow, RouteRow, RouteTable, build_table
from llmgw.store.database import create_engine, session_factory
from llmgw.store.demand import DEMAND_CHANNEL, read_demand
from llmgw.store.routes import ObservedAdapter
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(*, base_ready: bool = True) -> RouteTable:
    """Base "m" on replica r1; runtime adapters x (loaded nowhere) and y (loaded on r1)."""
    row = RouteRow(
        shard="s1",
        replica="r1",
        proxy_url="http://agent/shards/s1",
        api_key="k",
        ready=base_ready,
        index_model="m",
        profile={"name": "p", "engine": "sim", "model": "m"},
        max_in_flight=100,
        observed_adapters=(ObservedAdapter("y", "loaded"),),
        adapter_slots=2,
    )
    return build_table(
        [row],
        read_at=1.0,
        declared=[DeclaredRow("m", autoscaled=True, model="m", adapter_slots=2)],
        adapters=[AdapterRow("x", "m", "/a/x"), AdapterRow("y", "m", "/a/y")],
    )


def _flow(clock: _Clock) -> tuple[FlowControl, LoadTracker]:
    load = LoadTracker(eject_after=3, eject_for_s=5.0, clock=clock)
    metrics = GatewayMetrics.create(CollectorRegistry())
    return FlowControl(GatewaySettings(), load=load, metrics=metrics, clock=clock), load


async def test_adapter_rows_count_their_own_requests_and_their_bases_count_them_too(
    db_url: str,
) -> None:
    clock = _Clock()
    flow, load = _flow(clock)
    table = _table()
    flow.configure(table)
    # Ten requests for y reach admission in the first rate window and go on at once; three of
    # them are in flight now, beside two of the base model's own on the same replica.
    for _ in range(10):
        await flow.enter(table.routes["y"], "k", 0, 100)
        flow.release("y")
    for _ in range(3):
        flow.sending("y")
    for _ in range(2):
        flow.sending("m")
    load.in_flight["r1"] = 5  # what upstream counts on the replica: all five
    flow.done("m")
    flow.sending("m")
    # One for x, loaded nowhere: held while the leader places it.
    woken: list[int] = []
    flow.on_hold = lambda: woken.append(1)
    held = asyncio.create_task(flow.enter(table.routes["x"], "k", 0, 100, prompt_tokens=40))
    await until(lambda: flow.demand.get("x") and flow.demand["x"].held == 1, timeout_s=5,
                what="the request held for x")  # fmt: skip
    assert woken == [1]
    clock.now += 5.0  # the first rate window closes

    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    listener = await psycopg.AsyncConnection.connect(libpq_url(db_url), autocommit=True)
    try:
        await listener.execute(f"LISTEN {DEMAND_CHANNEL}")
        reporter = DemandReporter(sessions, instance_id="gw1", flow=lambda: flow, clock=clock)
        await reporter.report()
        # Held for an adapter: the report wakes the leader, as for a scale from zero.
        got = [n.channel async for n in listener.notifies(timeout=5, stop_after=1)]
        assert got == [DEMAND_CHANNEL]
        async with sessions() as s, s.begin():
            rows = {r.model: r for r in await read_demand(s, fresh_s=10)}
    finally:
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await listener.close()
        await engine.dispose()

    assert set(rows) == {"m", "x", "y"}
    x, y, m = rows["x"], rows["y"], rows["m"]
    # Each adapter: its own requests only, never its replica's.
    assert (x.queued, x.held, x.in_flight, x.engine_waiting) == (1, 1, 0, 0)
    assert (x.queued_prefill_tokens, x.uncached_prefill_tokens) == (40, 40)
    assert (y.queued, y.held, y.in_flight) == (0, 0, 3)
    # The base: its replica's in flight (its own and its adapters'), and the request held for
    # x as queued, not held (the base serves; the wait is a load, not a wake).
    assert (m.queued, m.held, m.in_flight) == (1, 0, 5)
    assert m.queued_prefill_tokens == 40
    # Requests per second over the closed window, blended at its weight (5 s of a minute's
    # average); the base's rate counts its adapters'.
    assert x.requests_per_s == pytest.approx(1 / 5 * 5 / 60)
    assert y.requests_per_s == pytest.approx(10 / 5 * 5 / 60)
    assert m.requests_per_s == pytest.approx(11 / 5 * 5 / 60)


async def test_a_request_held_for_an_adapter_of_a_model_at_zero_is_held_for_the_model() -> None:
    """The base has no ready replica: the adapter's held request wakes the base (its row's
    held is what the autoscaler wakes a deployment at zero on)."""
    clock = _Clock()
    flow, _ = _flow(clock)
    table = _table(base_ready=False)
    assert table.routes["x"].wakeable and table.routes["y"].endpoints == ()
    flow.configure(table)
    held = [asyncio.create_task(flow.enter(table.routes[name], "k", 0, 100)) for name in ("x", "y")]
    try:
        await until(lambda: sum(d.held for d in flow.demand.values()) == 2, timeout_s=5,
                    what="both held")  # fmt: skip
        rows = {d.model: d for d in flow.snapshot()}
        assert (rows["m"].queued, rows["m"].held) == (2, 2)
        assert (rows["x"].held, rows["y"].held) == (1, 1)
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    # The clients left: nothing held anywhere, and the rate decays over the next minute.
    rows = {d.model: d for d in flow.snapshot()}
    assert rows["m"].held == rows["x"].held == 0
    clock.now += 5.0
    assert {d.model: d for d in flow.snapshot()}["m"].requests_per_s == pytest.approx(2 / 60)
    clock.now += 120.0
    assert {d.model: d for d in flow.snapshot()}["m"].requests_per_s < 0.01
