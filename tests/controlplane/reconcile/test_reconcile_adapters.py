"""The leader's adapter placement against a real Postgres (issue [lora] "Adapters at runtime"):
a pass reads the declared adapters, their demand and the replicas of each base model, and
writes each rank-0 shard's desired_adapters (bumping its node's desired_version), the
adapters' status and a recorded action per change, in its fenced transaction.

Every fleet here is a model ``m`` with two deployments: ``lora`` (profile ``sim-lora``, two
adapter slots, two replicas) and ``plain`` (profile ``sim-p``, no slots, one replica), on
nodes that synced just now; replicas are marked ready over SQL, as agents would report them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from llmgw.controlplane.profile_checks import check_profile
from llmgw.controlplane.reconcile.leader import LeaderLock
from llmgw.controlplane.reconcile.loop import ReconcileMetrics, Reconciler
from llmgw.embedded_postgres import libpq_url
from llmgw.planner.snapshot import PlanSettings
from llmgw.store import fleet
from llmgw.store.database import create_engine, session_factory
from llmgw.store.demand import DEMAND_CHANNEL
from llmgw.store.notify import NotifyHub
from tests.support.sim_fleet import counted_statements, sim_inventory, sim_profile_fields
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(90)

_SETTINGS = PlanSettings(sync_period_s=1.0, sync_grace_s=3600.0, drain_timeout_s=60.0)


def _add_nodes(conn: psycopg.Connection, numbers: range, gpus: int) -> None:
    for i in numbers:
        node = conn.execute(
            "INSERT INTO nodes (name, approval_state) VALUES (%s, 'approved') RETURNING id",
            (f"node-{i:04d}",),
        ).fetchone()[0]  # type: ignore[index]
        conn.execute(
            "INSERT INTO node_status (node_id, mgmt_addr, inventory, last_sync_at) "
            "VALUES (%s, '127.0.0.1', %s, now())",
            (node, sim_inventory(gpus)),
        )


def _profile(conn: psycopg.Connection, model: object, name: str, slots: int) -> object:
    fingerprint = check_profile(name, sim_profile_fields(adapter_slots=slots), model="m")
    return conn.execute(
        "INSERT INTO profiles (name, model_id, engine, gpu_class, model_path, kv_hash_seed, "
        "adapter_slots, fingerprint) VALUES (%s, %s, 'sim', 'sim', 'sim-model', '4242', %s, %s) "
        "RETURNING id",
        (name, model, slots, fingerprint),
    ).fetchone()[0]  # type: ignore[index]


def _seed(url: str, *, nodes: int = 3, lora_slots: int = 2, lora_replicas: int = 2) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        model = conn.execute("INSERT INTO models (name) VALUES ('m') RETURNING id").fetchone()[0]  # type: ignore[index]
        other = conn.execute("INSERT INTO models (name) VALUES ('o') RETURNING id").fetchone()[0]  # type: ignore[index]
        lora = _profile(conn, model, "sim-lora", lora_slots)
        plain = _profile(conn, model, "sim-p", 0)
        # Another model with slots: an adapter of m must never land on its replica.
        other_p = _profile(conn, other, "sim-o", 4)
        for name, m, p, n in (
            ("lora", model, lora, lora_replicas),
            ("plain", model, plain, 1),
            ("other", other, other_p, 1),
        ):
            conn.execute(
                "INSERT INTO deployments (name, model_id, profile_id, replicas) "
                "VALUES (%s, %s, %s, %s)",
                (name, m, p, n),
            )
        _add_nodes(conn, range(nodes), 2)


def _sql(url: str, statement: str, *args: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, args)
        return cur.fetchall() if cur.description else []


def _adapter(url: str, name: str, **columns: object) -> None:
    cols = {"name": name, "model": "m", "path": f"/adapters/{name}", **columns}
    _sql(
        url,
        f"INSERT INTO adapters ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})",
        *cols.values(),
    )


def _demand(url: str, model: str, *, held: int = 0, queued: int = 0, rate: float = 0.0) -> None:
    _sql(
        url,
        "INSERT INTO gateway_demand (instance_id, model, queued, held, requests_per_s, "
        "updated_at) VALUES ('gw-1', %s, %s, %s, %s, now()) ON CONFLICT (instance_id, model) "
        "DO UPDATE SET queued = excluded.queued, held = excluded.held, "
        "requests_per_s = excluded.requests_per_s, updated_at = now()",
        model,
        max(queued, held),
        held,
        rate,
    )


def _desired(url: str) -> dict[str, list[str]]:
    """Deployment -> the adapter names each of its rank-0 shards is told to hold, sorted."""
    rows = _sql(
        url,
        "SELECT d.name, s.desired_adapters FROM shards s JOIN replicas r ON r.id = s.replica_id "
        "JOIN deployments d ON d.id = r.deployment_id WHERE s.rank = 0 ORDER BY d.name, s.id",
    )
    out: dict[str, list[str]] = {}
    for dep, adapters in rows:
        out.setdefault(dep, []).append(",".join(a["name"] for a in adapters))
    return {k: sorted(v) for k, v in out.items()}


def _versions(url: str) -> dict[str, int]:
    return dict(_sql(url, "SELECT name, desired_version FROM nodes"))  # type: ignore[arg-type]


def _ready(url: str) -> None:
    _sql(url, "UPDATE shards SET observed_state = 'ready'")


@pytest.fixture
async def shell(db_url: str) -> AsyncIterator[tuple[AsyncEngine, async_sessionmaker[AsyncSession]]]:
    engine = create_engine(db_url, pool_size=2)
    try:
        yield engine, session_factory(engine)
    finally:
        await engine.dispose()


@pytest.fixture
async def leader(db_url: str) -> AsyncIterator[int]:
    lock = LeaderLock(libpq_url(db_url), instance_id="cp-a")
    epoch = await lock.try_acquire()
    assert epoch is not None
    try:
        yield epoch
    finally:
        await lock.release()


def _reconciler(
    db_url: str, sessions: async_sessionmaker[AsyncSession], now: list[datetime] | None = None
) -> Reconciler:
    clock = (lambda: now[0]) if now is not None else (lambda: datetime.now(UTC))
    return Reconciler(
        sessions=sessions,
        libpq_url=libpq_url(db_url),
        instance_id="cp-a",
        plan_settings=_SETTINGS,
        clock=clock,
    )


async def _fleet_ready(url: str, rec: Reconciler, epoch: int) -> None:
    """Place the replicas, report them ready, and let a pass see them so."""
    await rec.pass_once(epoch)
    _ready(url)
    await rec.pass_once(epoch)


def _holding(url: str, adapter: str) -> int:
    """Rank-0 shards told to hold ``adapter``."""
    return int(
        _sql(
            url,
            "SELECT count(*) FROM shards WHERE desired_adapters @> %s::jsonb",
            json.dumps([{"name": adapter}]),
        )[0][0]
    )


async def test_demand_places_an_adapter_on_replicas_with_slots_and_records_it(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]], leader: int
) -> None:
    url = libpq_url(db_url)
    _seed(url)
    _, sessions = shell
    now = [datetime.now(UTC)]
    rec = _reconciler(db_url, sessions, now)
    await _fleet_ready(url, rec, leader)
    _adapter(url, "sql")
    # 12 req/s at 8 per holder asks for two holders: both replicas of `lora`, none of the
    # replica with no slots, none of the other model's.
    _demand(url, "sql", rate=12.0)
    before = _versions(url)
    counts = await rec.pass_once(leader)
    assert counts == {"AdapterScale": 1, "AdapterLoad": 2}
    assert _desired(url) == {"lora": ["sql", "sql"], "other": [""], "plain": [""]}
    entry = _sql(url, "SELECT desired_adapters FROM shards WHERE desired_adapters <> '[]'")[0][0]
    assert entry == [{"name": "sql", "path": "/adapters/sql", "pinned": False}]
    # The nodes of the two shards, and only they, got a new sync ETag.
    holders = {
        n
        for (n,) in _sql(
            url,
            "SELECT n.name FROM shards s JOIN nodes n ON n.id = s.node_id "
            "WHERE s.desired_adapters <> '[]'",
        )
    }
    after = _versions(url)
    assert {n for n in after if after[n] != before[n]} == holders
    assert all(after[n] == before[n] + 1 for n in holders)
    # The status the admin API reads, and the actions `llmgw get actions` lists.
    assert _sql(url, "SELECT adapter, desired_replicas, unplaced FROM adapter_status") == [
        ("sql", 2, "")
    ]
    async with sessions() as session:
        actions = await fleet.list_actions(session, deployment=None, before_id=None, limit=10)
    recorded = sorted(
        (a.action, a.deployment, bool(a.node), a.reason)
        for a in actions
        if a.action.startswith("Adapter")
    )
    assert [r[:3] for r in recorded] == [
        ("AdapterLoad", "lora", True),
        ("AdapterLoad", "lora", True),
        ("AdapterScale", "", False),
    ]
    assert recorded[2][3] == "adapter sql: 0 -> 2 replicas (demand 12 req/s and no holder)"
    assert all(r[3].startswith("adapter sql: load on ") for r in recorded[:2])

    # Level-triggered: the same world again writes nothing and records nothing.
    assert await rec.pass_once(leader) == {}
    assert _versions(url) == after
    assert _sql(
        url, "SELECT count(*) FROM reconcile_actions WHERE starts_with(action, 'Adapter')"
    ) == [(3,)]


async def test_a_held_request_for_an_adapter_loaded_nowhere_places_it_in_one_pass(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]], leader: int
) -> None:
    url = libpq_url(db_url)
    _seed(url)
    _, sessions = shell
    await _fleet_ready(url, _reconciler(db_url, sessions), leader)
    _adapter(url, "sql")
    # A new leader (nothing remembered), demand known but quiet: nothing is loaded for an
    # adapter nobody asks for.
    _demand(url, "m", queued=0)
    rec = _reconciler(db_url, sessions)
    assert await rec.pass_once(leader) == {}
    assert _desired(url)["lora"] == ["", ""]
    assert _sql(url, "SELECT desired_replicas FROM adapter_status") == [(0,)]
    # A gateway holds one request for it: the very next pass loads it on one replica.
    _demand(url, "sql", held=1)
    assert await rec.pass_once(leader) == {"AdapterScale": 1, "AdapterLoad": 1}
    assert _desired(url)["lora"] == ["", "sql"]
    reason = _sql(url, "SELECT reason FROM reconcile_actions WHERE action = 'AdapterScale'")
    assert reason == [("adapter sql: 0 -> 1 replicas (1 concurrent requests and no holder)",)]


async def test_a_held_request_wakes_the_loop_before_its_tick(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]]
) -> None:
    """The gateway NOTIFYs the demand channel when it holds a request; the loop, ticking once
    a minute here, passes on it, and an adapter-only demand is enough to place."""
    url = libpq_url(db_url)
    _seed(url)
    _, sessions = shell
    registry = CollectorRegistry()
    hub = NotifyHub(url, application_name="test-wake")
    rec = Reconciler(
        sessions=sessions,
        libpq_url=url,
        instance_id="cp-w",
        plan_settings=_SETTINGS,
        tick_s=60.0,
        metrics=ReconcileMetrics.create(registry),
        notify=hub,
    )

    def passes() -> float:
        return registry.get_sample_value("llmgw_reconcile_passes_total") or 0

    stop = asyncio.Event()
    async with hub:
        task = asyncio.create_task(rec.run(stop))
        try:
            await until(lambda: passes() >= 1, timeout_s=30, what="the first pass")
            _ready(url)
            _adapter(url, "sql")
            _demand(url, "sql", held=1)

            def woken() -> bool:
                # Each poll NOTIFYs as a gateway holding the request does: the hub may not be
                # listening yet the first time, and a notification is only a hint.
                _sql(url, "SELECT pg_notify(%s, '')", DEMAND_CHANNEL)
                return _desired(url).get("lora") == ["", "sql"]

            await until(woken, timeout_s=20, interval_s=0.2, what="the held adapter placed")
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=10)


async def test_an_adapter_no_profile_can_hold_says_which_profile_to_change(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]], leader: int
) -> None:
    url = libpq_url(db_url)
    _seed(url, lora_slots=0)
    _, sessions = shell
    rec = _reconciler(db_url, sessions)
    await _fleet_ready(url, rec, leader)
    _adapter(url, "sql")
    _demand(url, "sql", held=2)
    await rec.pass_once(leader)
    assert _desired(url) == {"lora": ["", ""], "other": [""], "plain": [""]}
    assert _sql(url, "SELECT desired_replicas, unplaced FROM adapter_status") == [
        (
            0,
            "no profile of model m holds adapters at runtime: set adapter_slots on profile "
            "sim-lora or sim-p (vLLM, SGLang and the simulator load adapters at runtime) or "
            "list it in the profile's adapters",
        )
    ]
    # An adapter of a model with no deployment says how to get one.
    _sql(url, "INSERT INTO models (name) VALUES ('bare')")
    _adapter(url, "orphan", model="bare")
    await rec.pass_once(leader)
    assert _sql(url, "SELECT unplaced FROM adapter_status WHERE adapter = 'orphan'") == [
        (
            "model bare has no deployment: deploy it with a profile that sets adapter_slots "
            "(vLLM, SGLang and the simulator load adapters at runtime)",
        )
    ]


async def test_unloads_follow_demand_down_and_a_deleted_adapter_is_cleared(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]], leader: int
) -> None:
    url = libpq_url(db_url)
    _seed(url)
    _, sessions = shell
    now = [datetime.now(UTC)]
    rec = _reconciler(db_url, sessions, now)
    await _fleet_ready(url, rec, leader)
    _adapter(url, "sql")
    _adapter(url, "chat", pinned=True)
    _demand(url, "sql", rate=12.0)
    await rec.pass_once(leader)
    # The pinned one keeps a holder without demand; sql is on both.
    assert (_holding(url, "sql"), _holding(url, "chat")) == (2, 1)
    # The agents report them loaded (sorted by name, as the agent API stores them).
    _sql(
        url,
        "UPDATE shards SET observed_adapters = (SELECT coalesce(jsonb_agg(jsonb_build_object("
        "'name', e ->> 'name', 'state', 'loaded', 'reason', '', 'failures', 0) "
        "ORDER BY e ->> 'name'), '[]') FROM jsonb_array_elements(desired_adapters) e)",
    )
    # Demand falls to one holder's worth; after the down window (300 s) one replica unloads.
    _demand(url, "sql", rate=2.0)
    assert await rec.pass_once(leader) == {}
    now[0] += timedelta(seconds=301)
    _demand(url, "sql", rate=2.0)
    counts = await rec.pass_once(leader)
    assert counts == {"AdapterScale": 1, "AdapterUnload": 1}
    assert (_holding(url, "sql"), _holding(url, "chat")) == (1, 1)
    # The agent has not unloaded yet (still reports it loaded): the same decision, not a new
    # one every pass.
    now[0] += timedelta(seconds=2)
    assert await rec.pass_once(leader) == {}
    # Deleted: every shard told to hold it is told not to, and its status row goes with it.
    _sql(url, "DELETE FROM adapters WHERE name = 'sql'")
    counts = await rec.pass_once(leader)
    assert counts == {"AdapterUnload": 1}
    assert (_holding(url, "sql"), _holding(url, "chat")) == (0, 1)
    assert _sql(url, "SELECT adapter FROM adapter_status") == [("chat",)]
    unload = _sql(url, "SELECT reason FROM reconcile_actions ORDER BY id DESC LIMIT 1")[0][0]
    assert unload.startswith("adapter sql: unload from ") and "no longer declared" in unload


async def test_a_pass_with_adapters_costs_the_same_statements_for_a_larger_fleet(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]], leader: int
) -> None:
    url = libpq_url(db_url)
    _seed(url, nodes=20, lora_replicas=10)
    engine, sessions = shell
    rec = _reconciler(db_url, sessions)
    await _fleet_ready(url, rec, leader)
    _adapter(url, "sql")
    _adapter(url, "chat")
    _demand(url, "sql", rate=30.0)
    await rec.pass_once(leader)  # places them
    with counted_statements(engine) as statements:
        await rec.pass_once(leader)
        small = len(statements)
        with psycopg.connect(url, autocommit=True) as conn:
            _add_nodes(conn, range(20, 60), 2)
        _sql(url, "UPDATE deployments SET replicas = 30 WHERE name = 'lora'")
        await rec.pass_once(leader)  # places the new replicas
        _ready(url)
        await rec.pass_once(leader)
        statements.clear()
        await rec.pass_once(leader)
        # The five of the snapshot, the epoch's, and the adapters' two: none per replica.
        assert len(statements) == small <= 10, json.dumps(statements, indent=1)
