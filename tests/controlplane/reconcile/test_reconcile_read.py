"""The reconcile pass's read against a real Postgres: every row kind becomes the view it should.

``load_snapshot`` reads rows as plain tuples (ids as text, a shard's GPUs aggregated beside
it) for speed at fleet scale; this pins what each stored shape reads back as, including the
rare ones a settled bench fleet never has: a node that never reported, MIG slices, a
released shard, a replica whose deployment was deleted, autoscaled deployments with and
without a stored decision, a rollout status row, a profile the engines refuse, stored GPU
classes.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from llmgw.controlplane.profile_checks import check_profile
from llmgw.controlplane.reconcile.read import load_snapshot
from llmgw.embedded_postgres import libpq_url
from llmgw.planner.autoscale import AutoscalePolicy, ScaleState
from llmgw.planner.snapshot import PlanSettings, RolloutStatus
from llmgw.store.database import create_engine, session_factory
from tests.support.sim_fleet import counted_statements, sim_profile_fields

pytestmark = pytest.mark.timeout(90)

_SETTINGS = PlanSettings(sync_period_s=1.0, sync_grace_s=30.0, drain_timeout_s=60.0)
_MIG_A = "MIG-aaaaaaaa-0000-0000-0000-000000000001"
_MIG_B = "MIG-aaaaaaaa-0000-0000-0000-000000000002"
_INVENTORY = {
    "gpus": [
        {"index": 0, "uuid": "GPU-0", "name": "sim", "simulated": True},
        {"index": 1, "uuid": "GPU-1", "name": "sim", "simulated": True},
        {"index": 2, "uuid": "GPU-2", "name": "sim", "simulated": True, "mig_enabled": True},
        {"index": 1000, "uuid": _MIG_A, "name": "sim", "simulated": True,
         "mig_parent_uuid": "GPU-2"},
        {"index": 1001, "uuid": _MIG_B, "name": "sim", "simulated": True,
         "mig_parent_uuid": "GPU-2"},
    ],
    "fabrics": [{"name": "ib0", "hcas": ["mlx5_0"], "gid_index": 3}],
    "cpu_threads": 16,
    "source": "sim",
}  # fmt: skip
_SYNC = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _one(conn: psycopg.Connection, sql: str, *args: object) -> str:
    row = conn.execute(sql, args).fetchone()
    assert row is not None
    return str(row[0])


def _seed(url: str) -> dict[str, str]:
    """The fleet described in the module docstring; returns its ids by name."""
    ids: dict[str, str] = {}
    fp = check_profile("sim-p", sim_profile_fields(tp=2))
    with psycopg.connect(url, autocommit=True) as c:
        model = ids["model"] = _one(c, "INSERT INTO models (name) VALUES ('m') RETURNING id")
        ids["profile"] = _one(
            c,
            "INSERT INTO profiles (name, model_id, engine, gpu_class, tp, model_path, "
            "kv_hash_seed, fingerprint) VALUES ('sim-p', %s, 'sim', 'sim', 2, 'sim-model', "
            "'4242', %s) RETURNING id",
            model,
            fp,
        )
        # An engine the engines package does not know: the profile cannot be launched.
        ids["broken_profile"] = _one(
            c,
            "INSERT INTO profiles (name, model_id, engine, gpu_class, model_path, "
            "kv_hash_seed, fingerprint) VALUES ('bad-p', %s, 'nosuch', 'h100', 'x', '1', 'fp-bad') "
            "RETURNING id",
            model,
        )
        for name, profile, extra in (
            ("plain", ids["profile"], ""),
            ("scaled", ids["profile"], "stored"),
            ("fresh", ids["profile"], "none stored"),
            ("broken", ids["broken_profile"], ""),
        ):
            ids[name] = _one(
                c,
                "INSERT INTO deployments (name, model_id, profile_id, replicas, pool, max_surge, "
                "max_unavailable, progress_deadline_s, generation, autoscale) "
                "VALUES (%s, %s, %s, 3, 'p1', '25%%', '1', 120, 4, %s) RETURNING id",
                name,
                model,
                profile,
                json.dumps({"min_replicas": 1, "max_replicas": 5, "future_key": 1})
                if extra
                else None,
            )
        c.execute(
            "INSERT INTO deployment_status (deployment_id, observed_generation, replicas, "
            "ready_replicas, updated_replicas, available_replicas, unavailable_replicas, "
            "suspended_replicas, stalled, reason, progress_started_at) "
            "VALUES (%s, 4, 3, 2, 3, 2, 1, 0, true, 'waiting', %s)",
            (ids["plain"], _SYNC),
        )
        c.execute(
            "INSERT INTO deployment_autoscale (deployment_id, desired_replicas, warm_replicas, "
            "last_scaled_at, idle_since) VALUES (%s, 2, 4, %s, %s)",
            (ids["scaled"], _SYNC, _SYNC + timedelta(seconds=1)),
        )
        ids["node"] = _one(
            c,
            "INSERT INTO nodes (name, approval_state, pool, cordoned) "
            "VALUES ('n-ok', 'approved', 'p1', true) RETURNING id",
        )
        c.execute(
            "INSERT INTO node_status (node_id, mgmt_addr, inventory, last_sync_at) "
            "VALUES (%s, '10.0.0.1', %s, %s)",
            (ids["node"], json.dumps(_INVENTORY), _SYNC),
        )
        ids["silent"] = _one(
            c, "INSERT INTO nodes (name, draining) VALUES ('n-silent', true) RETURNING id"
        )
        ids["r1"] = _one(
            c,
            "INSERT INTO replicas (deployment_id, profile_fingerprint) VALUES (%s, %s) "
            "RETURNING id",
            ids["plain"],
            fp,
        )
        ids["r2"] = _one(
            c,
            "INSERT INTO replicas (profile_fingerprint, state, reason, drain_deadline) "
            "VALUES ('old', 'stopping', 'deleted', %s) RETURNING id",
            _SYNC,
        )
        # Rank 1 inserted first: the view lists shards in rank order whatever the heap's.
        ids["s1"] = _one(
            c,
            "INSERT INTO shards (replica_id, node_id, rank, hcas, fabric, launch_spec, "
            "profile_fingerprint, observed_state, restarts) VALUES (%s, %s, 1, '{mlx5_0}', "
            "'ib0', '{\"threads\": 3, \"big\": [1, 2, 3]}', %s, 'ready', 2) RETURNING id",
            ids["r1"],
            ids["node"],
            fp,
        )
        ids["s0"] = _one(
            c,
            "INSERT INTO shards (replica_id, node_id, rank, leader_port, profile_fingerprint) "
            "VALUES (%s, %s, 0, 29500, %s) RETURNING id",
            ids["r1"],
            ids["node"],
            fp,
        )
        ids["s_released"] = _one(
            c,
            "INSERT INTO shards (replica_id, node_id, rank, profile_fingerprint, desired_state, "
            "released, observed_state, observed_reason) "
            "VALUES (%s, %s, 0, 'old', 'stopped', false, 'exited', 'bye') RETURNING id",
            ids["r2"],
            ids["node"],
        )
        # GPUs in position order 1, 0: the view follows position, not insertion.
        for shard, position, index, mig in (
            (ids["s1"], 1, 0, None),
            (ids["s1"], 0, 2, _MIG_B),
            (ids["s0"], 0, 1, None),
            (ids["s_released"], 0, 2, _MIG_A),
        ):
            c.execute(
                "INSERT INTO gpu_assignments (shard_id, position, node_id, gpu_index, mig_uuid) "
                "VALUES (%s, %s, %s, %s, %s)",
                (shard, position, ids["node"], index, mig),
            )
        # Released after the fact, as the agent reports it: its GPU rows follow (ON UPDATE
        # CASCADE) and no longer count as held.
        c.execute("UPDATE shards SET released = true WHERE id = %s", (ids["s_released"],))
        c.execute("INSERT INTO gpu_classes (name, pattern) VALUES ('h100', 'H100')")
    return ids


async def test_every_row_kind_reads_back_as_its_view(db_url: str) -> None:
    ids = _seed(libpq_url(db_url))
    engine = create_engine(db_url, pool_size=1)
    try:
        with counted_statements(engine) as statements:
            async with session_factory(engine)() as session, session.begin():
                now = datetime.now(UTC)
                state = await load_snapshot(session, settings=_SETTINGS, now=now)
    finally:
        await engine.dispose()
    assert len(statements) == 5, statements
    snap = state.snapshot

    deps = {d.name: d for d in snap.deployments}
    assert [d.name for d in snap.deployments] == ["broken", "fresh", "plain", "scaled"]
    plain = deps["plain"]
    assert (plain.id, plain.replicas, plain.pool, plain.max_surge, plain.max_unavailable) == (
        ids["plain"], 3, "p1", "25%", "1"
    )  # fmt: skip
    assert (plain.progress_deadline_s, plain.generation, plain.suspended) == (120, 4, False)
    assert plain.autoscale is None and plain.warm_replicas is None
    assert (plain.profile.name, plain.profile.engine, plain.profile.gpu_class) == (
        "sim-p", "sim", "sim"
    )  # fmt: skip
    assert plain.profile.requirements.gpus_per_node == 2
    assert plain.status == RolloutStatus(
        observed_generation=4,
        replicas=3,
        ready_replicas=2,
        updated_replicas=3,
        available_replicas=2,
        unavailable_replicas=1,
        suspended_replicas=0,
        stalled=True,
        reason="waiting",
        progress_started_at=_SYNC,
    )
    assert deps["scaled"].status == RolloutStatus()
    policy = AutoscalePolicy(min_replicas=1, max_replicas=5)
    assert deps["scaled"].autoscale == policy == deps["fresh"].autoscale
    assert (deps["scaled"].replicas, deps["scaled"].warm_replicas) == (2, 4)
    assert (deps["fresh"].replicas, deps["fresh"].warm_replicas) == (3, 3)
    assert state.scale == {
        ids["scaled"]: ScaleState(
            desired=2, warm=4, last_scaled_at=_SYNC, idle_since=_SYNC + timedelta(seconds=1)
        ),
        ids["fresh"]: ScaleState(desired=3, warm=3),
    }
    assert state.scale_stored == {ids["scaled"]}
    assert state.served == {ids["scaled"]: "m", ids["fresh"]: "m"}
    # The broken profile: no engines' Profile, frozen at its active replicas (none).
    assert set(state.broken) == {ids["broken"]} and "bad-p" in state.broken[ids["broken"]]
    assert deps["broken"].replicas == 0 and deps["broken"].profile.gpu_class == "h100"
    assert state.launch[ids["broken"]] == ("broken", None)
    plain_launch = state.launch[ids["plain"]][1]
    assert plain_launch is not None and plain_launch.model == "m" and plain_launch.tp == 2

    nodes = {n.name: n for n in snap.nodes}
    ok, silent = nodes["n-ok"], nodes["n-silent"]
    assert (ok.id, ok.pool, ok.approved, ok.cordoned, ok.draining) == (
        ids["node"], "p1", True, True, False
    )  # fmt: skip
    assert ok.last_sync_at == _SYNC and ok.cpu_threads == 16
    assert [g.key for g in ok.gpus] == ["0", "1", _MIG_A, _MIG_B]
    assert [f.name for f in ok.fabrics] == ["ib0"]
    assert (silent.approved, silent.draining, silent.last_sync_at, silent.gpus) == (
        False, True, None, ()
    )  # fmt: skip
    facts = state.nodes[ok.id]
    assert (facts.name, facts.mgmt_addr, dict(facts.gid_index)) == ("n-ok", "10.0.0.1", {"ib0": 3})
    assert facts.devices[_MIG_B] == (2, _MIG_B)
    assert state.nodes[silent.id].mgmt_addr == ""

    replicas = {r.id: r for r in snap.replicas}
    r1, r2 = replicas[ids["r1"]], replicas[ids["r2"]]
    assert r1.deployment_id == ids["plain"] and r1.state == "active"
    assert r2.deployment_id is None
    assert (r2.state, r2.reason, r2.drain_deadline) == ("stopping", "deleted", _SYNC)
    assert state.replica_deployment == {ids["r1"]: "plain", ids["r2"]: ""}
    s0, s1 = r1.shards
    assert (s0.id, s0.rank, s0.replica_id, s0.node_id) == (ids["s0"], 0, ids["r1"], ids["node"])
    assert (s0.gpu_indices, s0.gpu_keys, s0.leader_port, s0.threads) == ((1,), ("1",), 29500, 0)
    assert (s1.id, s1.rank, s1.hcas, s1.fabric, s1.threads) == (
        ids["s1"], 1, ("mlx5_0",), "ib0", 3
    )  # fmt: skip
    # Position order; a MIG slice goes by the index placement knows it by, keyed by its uuid.
    assert (s1.gpu_indices, s1.gpu_keys) == ((1001, 0), (_MIG_B, "0"))
    assert (s1.observed_state, s1.restarts, s1.desired_state) == ("ready", 2, "running")
    (gone,) = r2.shards
    assert (gone.released, gone.gpu_indices, gone.gpu_keys) == (True, (), ())
    assert (gone.desired_state, gone.observed_state, gone.observed_reason) == (
        "stopped", "exited", "bye"
    )  # fmt: skip

    assert ("h100", "H100") in snap.settings.gpu_class_patterns


async def test_an_inventory_is_read_anew_once_it_changes(db_url: str) -> None:
    """Inventories are parsed once and remembered by their text from one pass to the next:
    an unchanged one reads back the same, a changed one as it now is, never as it was."""
    ids = _seed(libpq_url(db_url))
    engine = create_engine(db_url, pool_size=1)
    sessions = session_factory(engine)

    async def gpus_and_devices() -> tuple[list[str], dict[str, object]]:
        async with sessions() as session, session.begin():
            state = await load_snapshot(session, settings=_SETTINGS, now=datetime.now(UTC))
        (node,) = (n for n in state.snapshot.nodes if n.id == ids["node"])
        return [g.key for g in node.gpus], dict(state.nodes[node.id].devices)

    try:
        first = await gpus_and_devices()
        assert first[0] == ["0", "1", _MIG_A, _MIG_B]
        assert await gpus_and_devices() == first
        # GPU 1 fell off the bus and MIG was turned off on GPU 2: its slices are gone and it
        # is whole again.
        changed = dict(_INVENTORY, gpus=[
            {"index": 0, "uuid": "GPU-0", "name": "sim", "simulated": True},
            {"index": 2, "uuid": "GPU-2", "name": "sim", "simulated": True},
        ])  # fmt: skip
        with psycopg.connect(libpq_url(db_url), autocommit=True) as c:
            c.execute(
                "UPDATE node_status SET inventory = %s WHERE node_id = %s",
                (json.dumps(changed), ids["node"]),
            )
        assert await gpus_and_devices() == (["0", "2"], {"0": (0, None), "2": (2, None)})
        with psycopg.connect(libpq_url(db_url), autocommit=True) as c:
            c.execute(
                "UPDATE node_status SET inventory = %s WHERE node_id = %s",
                (json.dumps(_INVENTORY), ids["node"]),
            )
        assert await gpus_and_devices() == first
    finally:
        await engine.dispose()
