"""The reconcile shell against a real Postgres: load, plan, apply, and load again.

The pure planner is property-tested on its own (tests/planner); these
tests prove the SQL half keeps its promises: what a pass writes reads back as a
snapshot on which the planner has nothing left to do, GPUs land in gpu_assignments,
every node whose desired shards change gets its desired_version bumped, queries per
pass do not grow with the fleet, and a fenced epoch writes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from llmgw.controlplane.profile_checks import check_profile
from llmgw.controlplane.reconcile.leader import FencedError, LeaderLock
from llmgw.controlplane.reconcile.loop import ReconcileMetrics, Reconciler
from llmgw.embedded_postgres import libpq_url
from llmgw.planner.snapshot import PlanSettings
from llmgw.store.database import create_engine, session_factory
from tests.support.sim_fleet import counted_statements, sim_inventory, sim_profile_fields
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(90)


def _add_nodes(conn: psycopg.Connection, numbers: range, gpus: int) -> None:
    """Approved nodes ``node-NNNN`` that synced just now, ``gpus`` simulated GPUs each."""
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


def _seed(url: str, *, nodes: int, gpus: int, replicas: int, tp: int = 1) -> None:
    """A model, a sim profile, a deployment, and nodes that synced just now."""
    fingerprint = check_profile("sim-p", sim_profile_fields(tp=tp, kv_events=True))
    with psycopg.connect(url, autocommit=True) as conn:
        model = conn.execute("INSERT INTO models (name) VALUES ('m') RETURNING id").fetchone()[0]  # type: ignore[index]
        profile = conn.execute(
            "INSERT INTO profiles (name, model_id, engine, gpu_class, tp, model_path, kv_events, "
            "kv_hash_seed, fingerprint) VALUES ('sim-p', %s, 'sim', 'sim', %s, 'sim-model', true, "
            "'4242', %s) RETURNING id",
            (model, tp, fingerprint),
        ).fetchone()[0]  # type: ignore[index]
        conn.execute(
            "INSERT INTO deployments (name, model_id, profile_id, replicas) VALUES ('d', %s, %s, %s)",
            (model, profile, replicas),
        )
        _add_nodes(conn, range(nodes), gpus)


def _scalar(url: str, sql: str, *args: object) -> object:
    with psycopg.connect(url) as conn:
        row = conn.execute(sql, args).fetchone()
        return row[0] if row else None


@pytest.fixture
async def shell(db_url: str) -> AsyncIterator[tuple[AsyncEngine, async_sessionmaker[AsyncSession]]]:
    engine = create_engine(db_url, pool_size=2)
    try:
        yield engine, session_factory(engine)
    finally:
        await engine.dispose()


def _reconciler(db_url: str, sessions: async_sessionmaker[AsyncSession], name: str) -> Reconciler:
    return Reconciler(
        sessions=sessions,
        libpq_url=libpq_url(db_url),
        instance_id=name,
        plan_settings=PlanSettings(sync_period_s=1.0, sync_grace_s=30.0, drain_timeout_s=60.0),
    )


async def _lead(db_url: str, name: str) -> tuple[LeaderLock, int]:
    lock = LeaderLock(libpq_url(db_url), instance_id=name)
    epoch = await lock.try_acquire()
    assert epoch is not None
    return lock, epoch


async def test_a_pass_places_and_a_second_pass_does_nothing(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]]
) -> None:
    url = libpq_url(db_url)
    _seed(url, nodes=2, gpus=4, replicas=3, tp=2)
    _, sessions = shell
    rec = _reconciler(db_url, sessions, "cp-a")
    lock, epoch = await _lead(db_url, "cp-a")
    try:
        counts = await rec.pass_once(epoch)
        assert counts.get("CreateReplica") == 3
        assert _scalar(url, "SELECT count(*) FROM replicas WHERE state = 'active'") == 3
        # tp=2: two GPUs per shard, each a row, no GPU twice among live shards.
        assert _scalar(url, "SELECT count(*) FROM gpu_assignments") == 6
        assert _scalar(url, "SELECT count(DISTINCT (node_id, gpu_index)) FROM gpu_assignments") == 6
        # Every node that got a shard has a new sync ETag; the spec names the replica and key-less.
        assert _scalar(url, "SELECT count(*) FROM nodes WHERE desired_version > 0") == 2
        spec = _scalar(url, "SELECT launch_spec FROM shards LIMIT 1")
        assert isinstance(spec, dict)
        assert spec["profile"]["engine"] == "sim"
        assert "api_key" not in spec and "gpu_indices" not in spec
        assert _scalar(url, "SELECT count(DISTINCT engine_api_key) FROM shards") == 3
        # Level-triggered and idempotent against the real database: nothing left to do.
        versions = _scalar(url, "SELECT sum(desired_version) FROM nodes")
        assert await rec.pass_once(epoch) == {}
        assert _scalar(url, "SELECT sum(desired_version) FROM nodes") == versions
        assert _scalar(url, "SELECT count(*) FROM reconcile_actions") == 3
        # The rollout status is recorded beside the deployment, not on its row.
        assert _scalar(url, "SELECT replicas FROM deployment_status") == 3
        assert _scalar(url, "SELECT version FROM deployments") == 1
    finally:
        await lock.release()


async def test_scale_down_drains_then_stops_and_releases(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]]
) -> None:
    url = libpq_url(db_url)
    _seed(url, nodes=1, gpus=4, replicas=3)
    _, sessions = shell
    now = [datetime.now(UTC)]
    rec = Reconciler(
        sessions=sessions,
        libpq_url=url,
        instance_id="cp-b",
        plan_settings=PlanSettings(sync_period_s=1.0, sync_grace_s=3600.0, drain_timeout_s=30.0),
        clock=lambda: now[0],
    )
    lock, epoch = await _lead(db_url, "cp-b")
    try:
        await rec.pass_once(epoch)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE shards SET observed_state = 'ready'")
            conn.execute("UPDATE deployments SET replicas = 1")
        await rec.pass_once(epoch)
        assert _scalar(url, "SELECT count(*) FROM replicas WHERE state = 'draining'") == 2
        # Draining keeps the engines running (out of routing) until the deadline.
        assert _scalar(url, "SELECT count(*) FROM shards WHERE desired_state = 'stopped'") == 0
        now[0] += timedelta(seconds=31)
        await rec.pass_once(epoch)
        assert _scalar(url, "SELECT count(*) FROM shards WHERE desired_state = 'stopped'") == 2
        # Reported exited alone proves nothing (a crash with a restart pending looks the same):
        # the replicas wait for the agent API to release the shards.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "UPDATE shards SET observed_state = 'exited' WHERE desired_state = 'stopped'"
            )
        assert await rec.pass_once(epoch) == {}
        assert _scalar(url, "SELECT count(*) FROM replicas") == 3
        # An agent on the current set reports them gone: released (GPUs free), rows deleted.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE shards SET released = true WHERE desired_state = 'stopped'")
        await rec.pass_once(epoch)
        assert _scalar(url, "SELECT count(*) FROM replicas") == 1
        assert _scalar(url, "SELECT count(*) FROM gpu_assignments") == 1
        assert await rec.pass_once(epoch) == {}
    finally:
        await lock.release()


async def test_queries_per_pass_do_not_grow_with_the_fleet(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]]
) -> None:
    url = libpq_url(db_url)
    _seed(url, nodes=60, gpus=8, replicas=40)
    engine, sessions = shell
    rec = _reconciler(db_url, sessions, "cp-c")
    lock, epoch = await _lead(db_url, "cp-c")
    try:
        await rec.pass_once(epoch)  # places everything
        with counted_statements(engine) as statements:
            await rec.pass_once(epoch)
            at_60 = len(statements)
            with psycopg.connect(url, autocommit=True) as conn:
                _add_nodes(conn, range(60, 120), 8)
            statements.clear()
            await rec.pass_once(epoch)
            assert len(statements) == at_60 <= 10, statements
    finally:
        await lock.release()


async def test_a_fenced_leader_writes_nothing(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]]
) -> None:
    url = libpq_url(db_url)
    _seed(url, nodes=1, gpus=2, replicas=1)
    _, sessions = shell
    old_lock, old_epoch = await _lead(db_url, "old")
    await old_lock.release()
    new_lock, _ = await _lead(db_url, "new")
    try:
        with pytest.raises(FencedError):
            await _reconciler(db_url, sessions, "old").pass_once(old_epoch)
        assert _scalar(url, "SELECT count(*) FROM replicas") == 0
    finally:
        await new_lock.release()


async def test_a_new_leader_after_an_outage_gives_nodes_a_grace_of_its_own(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]]
) -> None:
    """Every node's last sync is old after the control planes (or Postgres) were down: the
    leader that comes back must not read that as every node dying at once."""
    url = libpq_url(db_url)
    _seed(url, nodes=2, gpus=2, replicas=2)
    _, sessions = shell
    settings = PlanSettings(sync_period_s=1.0, sync_grace_s=10.0, drain_timeout_s=60.0)
    lock, epoch = await _lead(db_url, "cp-e")
    try:
        await Reconciler(
            sessions=sessions, libpq_url=url, instance_id="cp-e", plan_settings=settings
        ).pass_once(epoch)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE shards SET observed_state = 'ready'")
            # The outage: nobody could sync for ten minutes.
            conn.execute("UPDATE node_status SET last_sync_at = now() - interval '10 minutes'")
        now = [datetime.now(UTC)]
        back = Reconciler(
            sessions=sessions,
            libpq_url=url,
            instance_id="cp-e",
            plan_settings=settings,
            clock=lambda: now[0],
        )
        assert "StopReplica" not in await back.pass_once(epoch)
        now[0] += timedelta(seconds=5)
        assert "StopReplica" not in await back.pass_once(epoch)
        # Silent for longer than the grace as this leader has watched them: replaced.
        now[0] += timedelta(seconds=6)
        counts = await back.pass_once(epoch)
        assert counts.get("StopReplica") == 2, counts
        reasons = _scalar(url, "SELECT string_agg(reason, ';') FROM reconcile_actions")
        assert "stopped syncing" in str(reasons)
    finally:
        await lock.release()


async def test_the_loop_leads_and_passes_on_its_tick_alone(
    db_url: str, shell: tuple[AsyncEngine, async_sessionmaker[AsyncSession]]
) -> None:
    """No NOTIFY, no wake(): the loop's own timed wait is the tick (no scheduler, no thread)."""
    url = libpq_url(db_url)
    _seed(url, nodes=1, gpus=2, replicas=1)
    _, sessions = shell
    registry = CollectorRegistry()
    rec = Reconciler(
        sessions=sessions,
        libpq_url=url,
        instance_id="cp-t",
        plan_settings=PlanSettings(sync_period_s=1.0, sync_grace_s=30.0, drain_timeout_s=60.0),
        tick_s=0.05,
        metrics=ReconcileMetrics.create(registry),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(rec.run(stop))
    try:
        await until(
            lambda: (registry.get_sample_value("llmgw_reconcile_passes_total") or 0) >= 4,
            timeout_s=30,
            what="four passes on the tick",
        )
        assert rec.epoch is not None
        assert _scalar(url, "SELECT count(*) FROM replicas") == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    assert registry.get_sample_value("llmgw_reconcile_leader") == 0
