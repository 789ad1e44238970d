"""The plan on an autoscaled deployment: suspended replicas kept placed above the serving
count, woken before any new replica is placed, stopped (never woken first) when no longer
kept; status counts them suspended, not ready, and a settled fleet is complete."""

from __future__ import annotations

from dataclasses import replace

from llmgw.planner.actions import (
    CreateReplica,
    SetShardsDesiredState,
    StopReplica,
    UpdateRolloutStatus,
)
from llmgw.planner.autoscale import AutoscalePolicy
from llmgw.planner.status import status_actions
from tests.planner.planner_testkit import (
    T0,
    deployment,
    node,
    ready_count,
    run_until_settled,
    snapshot,
    step,
)

POLICY = AutoscalePolicy(min_replicas=0, max_replicas=4, target_waiting_requests=4)


def _settled(replicas: int, warm: int | None = None):  # type: ignore[no-untyped-def]
    d = deployment("d", replicas, autoscale=POLICY, warm_replicas=warm)
    return run_until_settled(snapshot([d], [node("n1", 4)]), T0)


def _with(snap, replicas: int, warm: int):  # type: ignore[no-untyped-def]
    (d,) = snap.deployments
    return replace(snap, deployments=(replace(d, replicas=replicas, warm_replicas=warm),))


def _suspended(snap) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for r in snap.replicas if any(s.desired_state == "suspended" for s in r.shards))


def test_idle_replicas_are_suspended_kept_placed_then_woken_before_any_create() -> None:
    snap, now, _ = _settled(2)
    assert ready_count(snap, "d") == 2
    # Idle: serve 0, keep 2 placed -> both suspended, none stopped.
    snap2, plan = step(_with(snap, 0, 2), now)
    kinds = [type(a) for a in plan.actions if not type(a).__name__.startswith("Update")]
    assert kinds == [SetShardsDesiredState, SetShardsDesiredState]
    assert _suspended(snap2) == 2 and ready_count(snap2, "d") == 0
    (status,) = [a.status for a in status_actions(snap, snap2, now, {})]
    assert (status.suspended_replicas, status.ready_replicas) == (2, 0)
    assert status.reason.startswith("complete") and "2 suspended" in status.reason
    # Settled: planning again does nothing.
    snap3, again = step(snap2, now)
    assert not [a for a in again.actions if not type(a).__name__.startswith("Update")]
    # Woken: serve 1 of the 2 placed -> one resume, no new placement.
    snap4, wake = step(_with(snap3, 1, 2), now)
    acts = [a for a in wake.actions if not type(a).__name__.startswith("Update")]
    assert [type(a) for a in acts] == [SetShardsDesiredState]
    assert acts[0].desired_state == "running" and "woken" in acts[0].reason
    # Serve 3 of 2 placed: wake the other, then place a third.
    _, more = step(_with(snap4, 3, 3), now)
    kinds = [type(a) for a in more.actions if not type(a).__name__.startswith("Update")]
    assert kinds == [SetShardsDesiredState, CreateReplica]


def test_suspended_replicas_no_longer_kept_are_stopped_without_a_wake() -> None:
    snap, now, _ = _settled(2)
    snap, _ = step(_with(snap, 0, 2), now)
    _, plan = step(_with(snap, 0, 0), now)
    acts = [a for a in plan.actions if not type(a).__name__.startswith("Update")]
    assert {type(a) for a in acts} == {StopReplica}
    assert len(acts) == 2


def test_a_deployment_without_a_policy_still_resumes_everything() -> None:
    d = deployment("d", 1)
    snap, now, _ = run_until_settled(snapshot([d], [node("n1", 4)]), T0)
    (r,) = snap.replicas
    asleep = replace(r, shards=tuple(replace(s, desired_state="suspended") for s in r.shards))
    _, plan = step(replace(snap, replicas=(asleep,)), now)
    assert any(
        isinstance(a, SetShardsDesiredState) and a.reason == "deployment resumed"
        for a in plan.actions
    )


def test_a_wake_while_the_stopped_replicas_still_hold_the_gpus_says_they_free_themselves() -> None:
    # One GPU: the replica scaled away still holds it (state stopping) until its agent
    # reports it gone, so the woken replica cannot be placed yet; the status must say that
    # this frees itself (the gateways hold requests on it instead of refusing them).
    d = deployment("d", 1, autoscale=POLICY, warm_replicas=0)
    snap, now, _ = run_until_settled(snapshot([d], [node("n1", 1)]), T0)
    suspended, _ = step(_with(snap, 0, 1), now)
    stopping, _ = step(_with(suspended, 0, 0), now)
    assert [r.state for r in stopping.replicas] == ["stopping"]
    _, wake = step(_with(stopping, 1, 1), now)
    (status,) = [a.status for a in wake.actions if isinstance(a, UpdateRolloutStatus)]
    assert "cannot place a replica" in status.reason, status.reason
    assert "waiting for stopping replicas to free their GPUs" in status.reason
