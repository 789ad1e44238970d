"""compute_plan table tests: one behaviour each, world in, actions out (the sample-controller's way)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from llmgw.errors import ConfigError, SpecError
from llmgw.planner import (
    CreateReplica,
    DeploymentView,
    DrainReplica,
    Plan,
    PlanSettings,
    SetShardsDesiredState,
    Snapshot,
    UpdateRolloutStatus,
    apply_to_snapshot,
    compute_plan,
    rollout_budget,
)
from tests.planner.planner_testkit import (
    T0,
    agents_step,
    deployment,
    node,
    profile,
    ready_count,
    run_until_settled,
    snapshot,
    step,
)


def _kinds(plan: Plan) -> list[str]:
    return [type(a).__name__ for a in plan.actions if not isinstance(a, UpdateRolloutStatus)]


def _edit(snap: Snapshot, **changes: object) -> Snapshot:
    d = snap.deployments[0]
    edited = replace(d, generation=d.generation + 1, **changes)  # type: ignore[arg-type]
    return replace(snap, deployments=(edited, *snap.deployments[1:]))


def _settled(d: DeploymentView, nodes: list, **kw: object):  # type: ignore[no-untyped-def,type-arg]
    return run_until_settled(snapshot([d], nodes, **kw), T0)  # type: ignore[arg-type]


def _assert_idempotent(snap: Snapshot, plan: Plan) -> None:
    again = compute_plan(apply_to_snapshot(snap, plan, plan.now), plan.now)
    assert again.actions == ()


# --- rollout budgets ---


@pytest.mark.parametrize(
    ("surge", "unavailable", "desired", "expected"),
    [
        ("1", "0", 3, (1, 0)),
        ("25%", "25%", 10, (3, 2)),  # surge rounds up, unavailable down
        ("10%", "10%", 3, (1, 0)),
        ("0", "10%", 3, (0, 1)),  # both zero after rounding: unavailable becomes 1
        ("0%", "0%", 5, (0, 1)),
        ("0", "2", 5, (0, 2)),
        ("100%", "0", 4, (4, 0)),
    ],
)
def test_rollout_budget_rounds_as_kubernetes(
    surge: str, unavailable: str, desired: int, expected: tuple[int, int]
) -> None:
    b = rollout_budget(surge, unavailable, desired)
    assert (b.max_surge, b.max_unavailable) == expected


def test_a_bad_budget_names_the_field_and_the_fix() -> None:
    with pytest.raises(SpecError) as err:
        rollout_budget("two", "0", 3)
    assert err.value.field == "max_surge"
    assert "write e.g. '1' or '25%'" in err.value.message


def test_a_sync_grace_under_five_periods_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        PlanSettings(sync_period_s=2.0, sync_grace_s=9.0)
    assert "shorter than 5 sync periods (10 s)" in err.value.message


# --- scale ---


def test_scale_up_creates_replicas_spread_and_reports_status() -> None:
    snap = snapshot([deployment("chat", 3, profile(gpus=4))], [node("a"), node("b")])
    plan = compute_plan(snap, T0)
    creates = [a for a in plan.actions if isinstance(a, CreateReplica)]
    assert [c.shards[0].node_id for c in creates] == ["a", "b", "a"]
    assert [c.reason for c in creates] == [
        "scale up: 0 of 3 replicas",
        "scale up: 1 of 3 replicas",
        "scale up: 2 of 3 replicas",
    ]
    assert creates[0].shards[0].gpu_keys == ("0", "1", "2", "3")
    assert [c.shards[0].leader_port for c in creates] == [29500, 29500, 29501]
    status = next(a for a in plan.actions if isinstance(a, UpdateRolloutStatus)).status
    assert (status.replicas, status.ready_replicas, status.updated_replicas) == (3, 0, 3)
    assert status.reason == "3 of 3 replicas updated, 0 ready"
    assert status.progress_started_at == T0
    _assert_idempotent(snap, plan)


def test_scale_zero_to_three_to_one() -> None:
    snap, now, _ = _settled(deployment("chat", 3, profile(gpus=2)), [node("a"), node("b")])
    assert ready_count(snap, "chat") == 3
    assert snap.deployments[0].status.reason == "complete: 3 of 3 replicas ready"
    snap = _edit(snap, replicas=1)
    snap, plan = step(snap, now)
    drains = [a for a in plan.actions if isinstance(a, DrainReplica)]
    assert len(drains) == 2
    assert {d.reason for d in drains} == {"scale down: 3 replicas, 1 desired"}
    assert {d.deadline for d in drains} == {now + timedelta(seconds=30)}
    # Draining replicas are out of routing at once, their engines keep running.
    assert ready_count(snap, "chat") == 1
    snap, now, _ = run_until_settled(snap, now)
    assert len(snap.replicas) == 1


def test_draining_stops_at_the_deadline_then_the_row_goes_when_engines_exit() -> None:
    snap, now, _ = _settled(deployment("chat", 1), [node("a")])
    snap = _edit(snap, replicas=0)
    snap, plan = step(snap, now)
    assert _kinds(plan) == ["DrainReplica"]
    snap, plan = step(snap, now + timedelta(seconds=29))
    assert _kinds(plan) == []
    snap, plan = step(snap, now + timedelta(seconds=30))
    assert _kinds(plan) == ["StopReplica"]
    assert plan.actions[0].reason == "drain deadline passed: scale down: 1 replicas, 0 desired"
    assert {s.desired_state for s in snap.replicas[0].shards} == {"stopped"}
    snap = agents_step(snap, now + timedelta(seconds=31))
    snap, plan = step(snap, now + timedelta(seconds=31))
    assert _kinds(plan) == ["DeleteReplica"]
    assert snap.replicas == ()


def test_a_report_of_exited_alone_frees_nothing() -> None:
    snap, now, _ = _settled(deployment("chat", 1), [node("a")])
    snap, _ = step(_edit(snap, replicas=0), now)
    r = snap.replicas[0]
    exited = replace(r, shards=tuple(replace(s, observed_state="exited") for s in r.shards))
    snap, plan = step(replace(snap, replicas=(exited,)), now + timedelta(seconds=1))
    # `exited` may be a crash with a restart pending (or a report from before the agent saw
    # the stop): the replica keeps draining and its GPUs stay held.
    assert [k for k in _kinds(plan) if k != "UpdateRolloutStatus"] == []
    snap, plan = step(snap, now + timedelta(seconds=31))
    assert _kinds(plan)[0] == "StopReplica"
    assert plan.actions[0].reason == "drain deadline passed: scale down: 1 replicas, 0 desired"
    # The agent API releases the shards once the agent reports on the set that stops them.
    r = snap.replicas[0]
    released = replace(r, shards=tuple(replace(s, released=True) for s in r.shards))
    snap, plan = step(replace(snap, replicas=(released,)), now + timedelta(seconds=32))
    assert [k for k in _kinds(plan) if k != "UpdateRolloutStatus"] == ["DeleteReplica"]


def test_a_multi_node_replica_is_released_shard_by_shard_and_deleted_whole() -> None:
    nodes = [node("a", fabrics=["ib0"]), node("b", fabrics=["ib0"])]
    snap, now, _ = _settled(deployment("big", 1, profile(gpus=8, nodes=2)), nodes)
    assert len(snap.replicas[0].shards) == 2
    snap, _ = step(_edit(snap, replicas=0), now)
    snap, _ = step(snap, now + timedelta(seconds=30))
    r = snap.replicas[0]
    half = replace(r, shards=(replace(r.shards[0], released=True), r.shards[1]))
    snap, plan = step(replace(snap, replicas=(half,)), now + timedelta(seconds=31))
    # One rank gone is not the replica gone: whole replicas only.
    assert [k for k in _kinds(plan) if k != "UpdateRolloutStatus"] == []
    snap = agents_step(snap, now + timedelta(seconds=32))
    snap, plan = step(snap, now + timedelta(seconds=32))
    assert [k for k in _kinds(plan) if k != "UpdateRolloutStatus"] == ["DeleteReplica"]


# --- rolling replacement ---


def test_rollout_surges_first_then_drains_old_once_the_new_one_is_ready() -> None:
    d = deployment("chat", 2, profile(gpus=2), max_surge="1", max_unavailable="0")
    snap, now, _ = _settled(d, [node("a"), node("b")])
    snap = _edit(snap, profile=profile("fp-2", gpus=2))
    snap, plan = step(snap, now)
    assert _kinds(plan) == ["CreateReplica"]
    assert plan.actions[0].reason == "rollout: surge replica for fingerprint fp-2"
    assert ready_count(snap, "chat") == 2
    snap = agents_step(agents_step(snap, now), now)  # the surge replica becomes ready
    snap, plan = step(snap, now)
    assert _kinds(plan) == ["DrainReplica", "CreateReplica"]
    assert plan.actions[0].reason == "rollout: profile fingerprint fp-1 is stale (now fp-2)"
    assert ready_count(snap, "chat") == 2


def test_rollout_in_place_when_no_surge_capacity_says_so() -> None:
    d = deployment("chat", 2, profile(gpus=8), max_surge="1", max_unavailable="1")
    snap, now, _ = _settled(d, [node("a"), node("b")])
    snap = _edit(snap, profile=profile("fp-2", gpus=8))
    plan = compute_plan(snap, now)
    assert _kinds(plan) == ["DrainReplica"]
    assert plan.actions[0].reason == (
        "rollout: profile fingerprint fp-1 is stale (now fp-2); replaced in place within "
        "max_unavailable 1: no capacity for a surge replica (needs 1 node with 8 free h100 "
        "GPUs in pool default; no node has them)"
    )
    _assert_idempotent(snap, plan)
    snap, now, _steps = run_until_settled(apply_to_snapshot(snap, plan, now), now)
    assert {r.profile_fingerprint for r in snap.replicas} == {"fp-2"}
    assert ready_count(snap, "chat") == 2


def test_rollout_with_no_capacity_and_no_unavailability_stalls_with_the_reason() -> None:
    d = deployment("chat", 2, profile(gpus=8), max_surge="1", max_unavailable="0")
    snap, now, _ = _settled(d, [node("a"), node("b")])
    snap = _edit(snap, profile=profile("fp-2", gpus=8))
    snap, plan = step(snap, now)
    assert _kinds(plan) == []
    status = snap.deployments[0].status
    assert not status.stalled
    assert status.reason == (
        "0 of 2 replicas updated, 2 ready; 2 to replace; cannot place a replica: needs 1 node "
        "with 8 free h100 GPUs in pool default; no node has them; a, b: 0 free h100 GPUs, "
        "needs 8; max_unavailable is 0, so old replicas cannot be replaced in place: add "
        "capacity or raise max_unavailable"
    )
    snap = agents_step(snap, now + timedelta(seconds=600))
    snap, plan = step(snap, now + timedelta(seconds=600))
    assert plan.actions == ()
    snap = agents_step(snap, now + timedelta(seconds=601))
    snap, plan = step(snap, now + timedelta(seconds=601))
    (update,) = plan.actions
    assert isinstance(update, UpdateRolloutStatus)
    assert update.status.stalled
    assert update.status.reason.startswith(
        "progress deadline 600 s exceeded: 0 of 2 replicas updated"
    )
    _assert_idempotent(snap, plan)


def test_multi_node_replicas_roll_whole() -> None:
    nodes = [node(n, fabrics=["ib0"]) for n in "abcd"]
    d = deployment("big", 1, profile(gpus=8, nodes=2), max_surge="1", max_unavailable="0")
    snap, now, _ = _settled(d, nodes)
    old = snap.replicas[0]
    snap = _edit(snap, profile=profile("fp-2", gpus=8, nodes=2))
    snap, now, _ = run_until_settled(snap, now)
    (new,) = snap.replicas
    assert new.id != old.id and len(new.shards) == 2
    assert {s.node_id for s in new.shards} == {"c", "d"}


def test_an_edit_that_keeps_the_fingerprint_restarts_nothing() -> None:
    snap, now, _ = _settled(deployment("chat", 2), [node("a")])
    snap = _edit(snap, progress_deadline_s=900)
    plan = compute_plan(snap, now)
    assert _kinds(plan) == []  # only the observed generation moves


# --- nodes ---


def test_a_node_that_stopped_syncing_has_its_replicas_replaced_elsewhere() -> None:
    snap, now, _ = _settled(deployment("chat", 1, profile(gpus=8)), [node("a"), node("b")])
    victim = snap.replicas[0].shards[0].node_id
    later = now + timedelta(seconds=11)
    snap = agents_step(snap, later, dead=frozenset({victim}))
    plan = compute_plan(snap, later)
    assert _kinds(plan) == ["StopReplica", "CreateReplica"]
    assert plan.actions[0].reason == (
        f"replacing replica: node {victim} stopped syncing: last sync 11 s ago (grace 10 s)"
    )
    assert plan.actions[1].shards[0].node_id != victim  # type: ignore[union-attr]
    _assert_idempotent(snap, plan)


def test_within_the_grace_period_nothing_moves() -> None:
    snap, now, _ = _settled(deployment("chat", 1), [node("a"), node("b")])
    assert compute_plan(snap, now + timedelta(seconds=10)).actions == ()


def test_cordon_blocks_new_placements_and_keeps_running_replicas() -> None:
    snap, now, _ = _settled(deployment("chat", 1, profile(gpus=8)), [node("a")])
    snap = replace(snap, nodes=(replace(snap.nodes[0], cordoned=True),))
    assert compute_plan(snap, now).actions == ()
    snap = _edit(snap, replicas=2)
    snap, plan = step(snap, now)
    assert _kinds(plan) == []
    assert "a: cordoned" in snap.deployments[0].status.reason


def test_drain_moves_replicas_off_the_node_surge_first_then_stops_them() -> None:
    snap, now, _ = _settled(deployment("chat", 1, profile(gpus=8)), [node("a"), node("b")])
    on = snap.replicas[0].shards[0].node_id
    snap = replace(snap, nodes=tuple(replace(n, draining=n.id == on) for n in snap.nodes))
    snap, plan = step(snap, now)
    assert _kinds(plan) == ["CreateReplica"]
    assert plan.actions[0].shards[0].node_id != on  # type: ignore[union-attr]
    snap, now, _ = run_until_settled(snap, now)
    assert [s.node_id for r in snap.replicas for s in r.shards] != [on]
    assert ready_count(snap, "chat") == 1


# --- suspend / resume ---


def test_suspend_keeps_placement_and_resume_runs_the_same_replicas() -> None:
    snap, now, _ = _settled(deployment("chat", 2), [node("a")])
    placed = {r.id: r.shards for r in snap.replicas}
    snap, plan = step(_edit(snap, suspended=True), now)
    assert _kinds(plan) == ["SetShardsDesiredState"] * 2
    assert {a.desired_state for a in plan.actions if isinstance(a, SetShardsDesiredState)} == {
        "suspended"
    }
    assert snap.deployments[0].status.reason == (
        "suspended: 2 replicas keep their placement, engines suspended"
    )
    snap, plan = step(_edit(snap, suspended=False), now)
    assert {a.reason for a in plan.actions if isinstance(a, SetShardsDesiredState)} == {
        "deployment resumed"
    }
    assert {r.id for r in snap.replicas} == set(placed)
    assert [s.gpu_keys for r in snap.replicas for s in r.shards] == [
        s.gpu_keys for shards in placed.values() for s in shards
    ]


# --- crash loops ---


def test_a_crash_looping_shard_has_its_replica_replaced_on_another_node() -> None:
    snap, now, _ = _settled(deployment("chat", 1, profile(gpus=8)), [node("a"), node("b")])
    r = snap.replicas[0]
    where = r.shards[0].node_id
    looping = replace(
        r.shards[0], observed_state="starting", restarts=3, observed_reason="exit code 1: CUDA OOM"
    )
    snap = replace(snap, replicas=(replace(r, shards=(looping,)),))
    plan = compute_plan(snap, now)
    assert _kinds(plan) == ["StopReplica", "CreateReplica"]
    assert plan.actions[0].reason == (
        f"replacing replica: shard rank 0 on node {where} is crash-looping: starting, "
        "3 restarts (limit 3); last: exit code 1: CUDA OOM"
    )
    assert plan.actions[1].shards[0].node_id != where  # type: ignore[union-attr]
    _assert_idempotent(snap, plan)


def test_below_the_restart_limit_nothing_is_replaced() -> None:
    snap, now, _ = _settled(deployment("chat", 1), [node("a"), node("b")])
    r = snap.replicas[0]
    snap = replace(snap, replicas=(replace(r, shards=(replace(r.shards[0], restarts=2),)),))
    assert compute_plan(snap, now).actions == ()


# --- deleted deployments ---


def test_a_deleted_deployment_is_drained_then_stopped_then_removed() -> None:
    snap, now, _ = _settled(deployment("chat", 2), [node("a")])
    orphans = tuple(replace(r, deployment_id=None) for r in snap.replicas)
    snap = replace(snap, deployments=(), replicas=orphans)
    snap, plan = step(snap, now)
    assert _kinds(plan) == ["DrainReplica", "DrainReplica"]
    assert {a.reason for a in plan.actions} == {"deployment deleted"}
    snap, now, _ = run_until_settled(snap, now)
    assert snap.replicas == ()


def test_unready_surplus_is_stopped_without_draining() -> None:
    snap = snapshot([deployment("chat", 2)], [node("a")])
    snap, _ = step(snap, T0)
    snap, plan = step(_edit(snap, replicas=0), T0)
    assert _kinds(plan) == ["StopReplica", "StopReplica"]


# --- status, determinism ---


def test_status_counts_and_observed_generation() -> None:
    snap, now, _ = _settled(deployment("chat", 2), [node("a")])
    snap = _edit(snap, replicas=4)  # generation 2
    snap = replace(snap, nodes=(replace(snap.nodes[0], cordoned=True),))
    snap, plan = step(snap, now)
    status = snap.deployments[0].status
    assert status.observed_generation == 2
    assert (
        status.replicas,
        status.ready_replicas,
        status.updated_replicas,
        status.available_replicas,
        status.unavailable_replicas,
        status.stalled,
    ) == (2, 2, 2, 2, 2, False)
    assert status.progress_started_at == now
    assert plan.unplaced == (
        (
            "chat",
            "needs 1 node with 1 free h100 GPU in pool default; no node has them; a: cordoned",
        ),
    )


def test_a_failed_shard_counts_as_a_crash_loop() -> None:
    snap, now, _ = _settled(deployment("chat", 1), [node("a"), node("b")])
    r = snap.replicas[0]
    failed = replace(r.shards[0], observed_state="failed", observed_reason="exit code 137")
    snap = replace(snap, replicas=(replace(r, shards=(failed,)),))
    plan = compute_plan(snap, now)
    # Stopped and replaced elsewhere at once; its row (and GPUs) wait for the release.
    assert [k for k in _kinds(plan) if k != "UpdateRolloutStatus"] == [
        "StopReplica",
        "CreateReplica",
    ]
    assert "is crash-looping: failed, 0 restarts (limit 3); last: exit code 137" in (
        plan.actions[0].reason
    )
    assert plan.actions[1].shards[0].node_id != r.shards[0].node_id  # type: ignore[union-attr]


def test_cpu_deployments_get_threads_on_nodes_of_their_pool() -> None:
    cpu = profile(engine="llamacpp", gpu_class="cpu", threads=8)
    nodes = [node("gpu", 8, threads=64), node("cpu", 0, threads=16, pool="cpu")]
    plan = compute_plan(snapshot([deployment("small", 2, cpu, pool="cpu")], nodes), T0)
    creates = [a for a in plan.actions if isinstance(a, CreateReplica)]
    assert [(c.shards[0].node_id, c.shards[0].threads, c.shards[0].gpu_keys) for c in creates] == [
        ("cpu", 8, ()),
        ("cpu", 8, ()),
    ]


def test_mig_instances_are_assigned_by_uuid_key() -> None:
    plan = compute_plan(snapshot([deployment("tiny", 1)], [node("a", 1, mig={0: 2})]), T0)
    (create,) = [a for a in plan.actions if isinstance(a, CreateReplica)]
    assert (create.shards[0].gpu_indices, create.shards[0].gpu_keys) == ((1000,), ("MIG-a-1000",))


def test_the_plan_is_a_pure_function_of_its_input() -> None:
    snap = snapshot(
        [deployment("a", 2), deployment("b", 1, profile(gpus=4))], [node("x"), node("y")]
    )
    assert compute_plan(snap, T0) == compute_plan(snap, T0)
    ids = [a.replica_id for a in compute_plan(snap, T0).actions if isinstance(a, CreateReplica)]
    assert len(set(ids)) == 3
