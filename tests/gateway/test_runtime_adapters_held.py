"""Requests for a runtime LoRA adapter (issue [lora], "Routing") through the real gateway app and
a real simulator (served in process, with vLLM's runtime LoRA routes), the route table read
from Postgres by the real ``RouteCache``: a request for an adapter loaded nowhere is held, wakes
the leader (``on_hold``), and goes to the replica once its agent reports the adapter loaded
(the shards trigger's NOTIFY re-reads the table); a load that failed on every replica the
leader chose answers the held request at once with the engine's reason, and refuses the next
one; a wait that runs out is a 503 naming the adapter; an unknown name that reads like an
adapter request gets a 404 naming the adapters the key may use.

The agent is played by the test: it calls the engine's load route and writes what an agent's
sync writes (``shards.desired_adapters`` is the leader's, ``observed_adapters`` the agent
API's)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from llmgw.config import GatewaySettings
from llmgw.embedded_postgres import libpq_url
from llmgw.gateway.routes import (
    AdapterRow,
    DeclaredRow,
    ModelRoute,
    RouteCache,
    RouteRow,
    RouteTable,
    build_table,
)
from llmgw.simengine.config import SimEngineConfig
from llmgw.simengine.engine import SimEngine
from llmgw.simengine.http_app import build_app
from llmgw.simengine.timing import TimingModel
from llmgw.store.database import create_engine, session_factory
from llmgw.store.notify import NotifyHub
from tests.controlplane.agentapi.agentapi_testkit import place_shard
from tests.gateway.gateway_testkit import Key, Served, serve_asgi, serve_gateway
from tests.support.waiting import until, wait_for

pytestmark = pytest.mark.timeout(90)

KEYS = {"sa": Key("ka", "tenant-a")}
AUTH = {"Authorization": "Bearer llmgw_ka_sa"}


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture
def sim() -> Iterator[str]:
    """The simulator serving base model "m", runtime LoRA loading allowed."""
    engine = SimEngine(
        SimEngineConfig(
            model="m",
            served_model_name="m",
            timing=TimingModel(time_scale=0),
            allow_runtime_lora_updating=True,
            lora_load_time_s=0.05,
            max_loras=2,
        )
    )
    with serve_asgi(build_app(engine), lifespan="on") as url:
        wait_for(
            lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200,
            timeout_s=20,
            what="the simulator's /health",
        )
        yield url


class _DbRoutes:
    """The real route cache over Postgres with its LISTEN hub, started on the gateway's loop
    (the gateway's ``routes`` source)."""

    def __init__(self, db_url: str) -> None:
        self._db_url = db_url
        self.cache: RouteCache | None = None

    @property
    def table(self) -> RouteTable:
        return self.cache.table if self.cache is not None else RouteTable({}, 0.0)

    async def start(self) -> None:
        self._engine = create_engine(self._db_url, pool_size=2)
        self._hub = NotifyHub(libpq_url(self._db_url), application_name="llmgw-test-adapters")
        # A minute's period: only a NOTIFY can bring a change within the tests' deadlines.
        self.cache = RouteCache(session_factory(self._engine), notify=self._hub, refresh_s=60.0)
        await self._hub.start()
        await self.cache.start()

    async def stop(self) -> None:
        assert self.cache is not None
        await self.cache.stop()
        await self._hub.stop()
        await self._engine.dispose()


async def _sql(sessions: async_sessionmaker[AsyncSession], sql: str, **params: Any) -> None:
    async with sessions() as session, session.begin():
        await session.execute(text(sql), params)


async def _fleet(db_url: str, sim_url: str, adapter_dir: Path) -> tuple[AsyncEngine, str]:
    """Model "m" with one ready replica (the simulator) whose profile holds runtime adapters,
    and two declared adapters: x (a directory the engine finds), y (a path it does not)."""
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    async with sessions() as session, session.begin():
        node = await session.execute(text("INSERT INTO nodes (name) VALUES ('n1') RETURNING id"))
        node_id = str(node.scalar_one())
    shard = await place_shard(sessions, node_id, gpus=(0,), model="m")
    await _sql(
        sessions,
        "UPDATE shards SET observed_state = 'ready', proxy_url = :url WHERE id = :id",
        id=shard,
        url=sim_url,
    )
    await _sql(sessions, "UPDATE profiles SET adapter_slots = 2 WHERE name = 'm-sim'")
    await _sql(
        sessions,
        "INSERT INTO adapters (name, model, path) VALUES ('x', 'm', :x), ('y', 'm', '/no/such/y')",
        x=str(adapter_dir),
    )
    return engine, shard


async def _agent_reports(
    sessions: async_sessionmaker[AsyncSession], shard: str, **states: tuple[str, str]
) -> None:
    """What the leader and the agent API write for the shard: the adapters placed on it, and
    each one's state and reason as its agent reports them."""
    desired = [{"name": n, "path": "-", "pinned": False} for n in states]
    observed = [
        {"name": n, "state": st, "reason": why, "failures": int(st == "failed")}
        for n, (st, why) in states.items()
    ]
    await _sql(
        sessions,
        "UPDATE shards SET desired_adapters = CAST(:d AS jsonb), "
        "observed_adapters = CAST(:o AS jsonb) WHERE id = :id",
        d=json.dumps(desired),
        o=json.dumps(observed),
        id=shard,
    )


def _metric(gw: Served, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", gw.metrics_text(), re.M)
    return float(found.group(1)) if found else 0.0


async def test_a_held_adapter_request_goes_on_when_loaded_and_fails_fast_when_the_load_failed(
    db_url: str, sim: str, tmp_path: Path
) -> None:
    adapter_dir = tmp_path / "x"
    adapter_dir.mkdir()
    engine, shard = await _fleet(db_url, sim, adapter_dir)
    sessions = session_factory(engine)
    routes = _DbRoutes(db_url)
    settings = GatewaySettings(queue_timeout_s=30)
    try:
        with serve_gateway(
            routes, KEYS, settings=settings, starts=[routes.start], stops=[routes.stop]
        ) as gw:
            flow = gw.gateway.flow
            holds: list[int] = []
            flow.on_hold = lambda: holds.append(1)  # the demand reporter's wake of the leader
            assert routes.cache is not None
            await until(routes.cache.listening.is_set, timeout_s=10, what="the cache to LISTEN")
            x = routes.table.routes["x"]
            assert (x.runtime, x.endpoints, x.wakeable, x.adapter_blocked) == (True, (), True, None)

            async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=40) as http:
                # --- held, then loaded ---------------------------------------------------
                asked = asyncio.create_task(http.post("/v1/chat/completions", json=_chat("x")))
                await until(
                    lambda: flow.demand.get("x") and flow.demand["x"].held == 1,
                    timeout_s=10,
                    what="the request held for x",
                )
                assert holds == [1] and not asked.done()
                # Reported on flow control's tick: the gauge, and the base model's row, which
                # counts it as queued (its replicas will run it), not held (the base serves).
                await until(
                    lambda: _metric(gw, "llmgw_gateway_adapter_held_requests", adapter="x") == 1,
                    timeout_s=5,
                    what="the held gauge at 1",
                )
                base = flow.demand["m"]
                assert (base.queued, base.held) == (1, 0)

                # The agent loads it into the engine, then reports it loaded.
                async with httpx.AsyncClient(base_url=sim, timeout=10) as engine_http:
                    loaded = await engine_http.post(
                        "/v1/load_lora_adapter",
                        json={"lora_name": "x", "lora_path": str(adapter_dir)},
                    )
                    assert loaded.status_code == 200, loaded.text
                    refused = await engine_http.post(
                        "/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "/no/such/y"}
                    )
                assert refused.status_code == 404, refused.text
                reason = refused.json()["error"]["message"]
                reported = time.monotonic()
                await _agent_reports(sessions, shard, x=("loaded", ""))
                answer = await asyncio.wait_for(asked, timeout=10)
                assert answer.status_code == 200, answer.text
                assert answer.json()["model"] == "x"  # the engine ran it with the adapter
                assert time.monotonic() - reported < 5  # the NOTIFY, not the minute's period
                assert _metric(
                    gw, "llmgw_gateway_adapter_held_answered_total", adapter="x", outcome="loaded"
                ) == 1.0  # fmt: skip
                await until(
                    lambda: _metric(gw, "llmgw_gateway_adapter_held_requests", adapter="x") == 0,
                    timeout_s=5,
                    what="the held gauge back to 0",
                )
                # Loaded: the next request goes at once.
                again = await http.post("/v1/chat/completions", json=_chat("x"))
                assert again.status_code == 200 and again.json()["model"] == "x"

                # --- held, then the load failed on every replica chosen ---------------
                held_y = asyncio.create_task(http.post("/v1/chat/completions", json=_chat("y")))
                await until(
                    lambda: flow.demand.get("y") and flow.demand["y"].held == 1,
                    timeout_s=10,
                    what="the request held for y",
                )
                started = time.monotonic()
                await _agent_reports(sessions, shard, x=("loaded", ""), y=("failed", reason))
                failed = await asyncio.wait_for(held_y, timeout=10)
                assert time.monotonic() - started < 5  # at once, not after queue_timeout_s
                want = (
                    f"adapter 'y' failed to load on replica {routes.table.routes['m'].endpoints[0].replica}: "
                    f"{reason}; fix its path (`llmgw get adapters y`)"
                )
                assert failed.status_code == 503, failed.text
                assert failed.json()["error"] == {
                    "message": want,
                    "type": "api_error",
                    "param": None,
                    "code": "adapter_load_failed",
                }
                assert failed.headers["Retry-After"] == "30"
                assert "No adapter found for /no/such/y" in want
                # A new request is refused at once, not held.
                started = time.monotonic()
                refused_now = await http.post("/v1/chat/completions", json=_chat("y"))
                assert refused_now.status_code == 503
                assert refused_now.json()["error"]["code"] == "adapter_load_failed"
                assert time.monotonic() - started < 2
                assert _metric(
                    gw, "llmgw_gateway_adapter_held_answered_total", adapter="y", outcome="failed"
                ) == 1.0  # fmt: skip
                assert _metric(
                    gw, "llmgw_gateway_shed_total", model="y", reason="adapter_load_failed"
                ) == 2.0  # fmt: skip
                # x still serves beside it.
                still = await http.post("/v1/chat/completions", json=_chat("x"))
                assert still.status_code == 200
    finally:
        await engine.dispose()


# --- without a database: the wait that runs out, the 404's hint -----------------------------


def _table(*, base_ready: bool) -> RouteTable:
    """Base "m" (one replica, nothing listening on it; autoscaled: held at zero too) with a
    runtime adapter "m-sql" loaded nowhere, placeable (the profile has slots)."""
    row = RouteRow(
        shard="s1",
        replica="r1",
        proxy_url="http://127.0.0.1:9",
        api_key="k",
        ready=base_ready,
        index_model="m",
        profile={"name": "p", "engine": "sim", "model": "m"},
        adapter_slots=1,
    )
    declared = [DeclaredRow("m", autoscaled=True, model="m", adapter_slots=1)]
    adapters = [AdapterRow("m-sql", "m", "/adapters/m-sql")]
    return build_table([row], read_at=1.0, declared=declared, adapters=adapters)


@pytest.mark.parametrize(
    ("base_ready", "what"),
    [
        (True, "is being loaded on a replica of model 'm'"),
        (False, "waits for a replica of model 'm' to start and load it"),
    ],
)
def test_a_held_adapter_request_past_the_queue_timeout_is_a_503_naming_the_adapter(
    base_ready: bool, what: str
) -> None:
    table = _table(base_ready=base_ready)
    route: ModelRoute = table.routes["m-sql"]
    assert route.runtime and route.wakeable and route.endpoints == ()
    settings = GatewaySettings(queue_timeout_s=0.3)
    with serve_gateway(table, KEYS, settings=settings) as gw:
        started = time.monotonic()
        r = httpx.post(
            f"{gw.url}/v1/chat/completions", json=_chat("m-sql"), headers=AUTH, timeout=10
        )
        assert time.monotonic() - started >= 0.3  # held for the wait, then answered
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "5"
        assert r.json()["error"] == {
            "message": f"adapter 'm-sql' {what}; retry after the time in Retry-After "
            "(`llmgw get adapters m-sql` shows where it is placed)",
            "type": "api_error",
            "param": None,
            "code": "adapter_loading",
        }
        assert _metric(
            gw, "llmgw_gateway_adapter_held_answered_total", adapter="m-sql", outcome="timeout"
        ) == 1.0  # fmt: skip
        assert (
            _metric(gw, "llmgw_gateway_shed_total", model="m-sql", reason="adapter_loading") == 1.0
        )


def test_an_unknown_name_like_an_adapter_request_is_a_404_naming_the_adapters() -> None:
    with serve_gateway(_table(base_ready=True), KEYS) as gw:
        r = httpx.post(
            f"{gw.url}/v1/chat/completions", json=_chat("m-sqll"), headers=AUTH, timeout=10
        )
        assert r.status_code == 404
        assert r.json()["error"] == {
            "message": "the model 'm-sqll' does not exist or this key may not use it; adapters "
            "of 'm' this key may use: m-sql; GET /v1/models lists the models this key can use",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        # A name like none: the 404 as it always was.
        r = httpx.post(
            f"{gw.url}/v1/chat/completions", json=_chat("other"), headers=AUTH, timeout=10
        )
        assert r.json()["error"]["message"] == (
            "the model 'other' does not exist or this key may not use it; GET /v1/models lists "
            "the models this key can use"
        )
