"""The plan on an autoscaled deployment: suspended replicas kept placed above the serving
count, woken before any new replica is placed, stopped (never woken first) when no longer
kept; status counts them suspended, not ready, and a settled fleet is complete."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from llmgw.engines import Profile as EngineProfile
from llmgw.planner.actions import (
    CreateReplica,
    SetShardsDesiredState,
    StopReplica,
    UpdateRolloutStatus,
)
from llmgw.planner.autoscale import AutoscalePolicy, ScaleState
from llmgw.planner.intake import launch_of
from llmgw.planner.scaling import DemandHistory, scale_snapshot
from llmgw.planner.snapshot import DeploymentId
from llmgw.planner.status import status_actions
from tests.planner.planner_testkit import (
    T0,
    deployment,
    node,
    profile,
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


CPU_VLLM = "vLLM's sleep mode is CUDA-only, and the profile runs on the CPU"


def test_replicas_that_cannot_suspend_are_said_to_be_stopped_not_suspended() -> None:
    """Issue 35: where the profile's engine cannot suspend, the agent stops a replica desired
    suspended; the plan, the autoscaler and the status say so (and say why)."""
    prof = profile(engine="vllm", gpu_class="cpu", threads=2)
    prof = replace(prof, suspend_refusal=CPU_VLLM)
    d = deployment("d", 1, prof, autoscale=POLICY, warm_replicas=1)
    snap, now, _ = run_until_settled(snapshot([d], [node("n1", 0, threads=8)]), T0)
    assert ready_count(snap, "d") == 1
    # A warm count above the serving one (state from before the profile lost its sleep):
    # the plan keeps it placed, as for any engine, but names what its agent does.
    snap2, plan = step(_with(snap, 0, 1), now)
    (act,) = [a for a in plan.actions if isinstance(a, SetShardsDesiredState)]
    assert act.reason == f"autoscale: idle, kept placed with its engine stopped ({CPU_VLLM})"
    (status,) = [a.status for a in status_actions(snap, snap2, now, {})]
    assert status.reason.endswith(f"; 1 suspended (engines stopped: {CPU_VLLM})")
    # And the autoscaler, asked through the pass, stops it rather than keep it.
    h = DemandHistory()
    h.record(now, {"m"}, {})
    h.record(now + timedelta(seconds=700), {"m"}, {})
    _, decisions = scale_snapshot(
        _with(snap2, 0, 1), history=h, served={DeploymentId("d"): "m"},
        state={DeploymentId("d"): ScaleState(0, 1, suspended_since=now)}, broken={},
        now=now + timedelta(seconds=700),
    )  # fmt: skip
    decision = decisions[DeploymentId("d")]
    assert (decision.desired, decision.warm) == (0, 0)
    assert decision.reason == f"stopped 1 suspended replicas: they cannot suspend ({CPU_VLLM})"
    # An operator's suspend of the whole deployment keeps placement; status names the stop.
    paused = replace(snap, deployments=(replace(snap.deployments[0], suspended=True),))
    snap3, _ = step(paused, now)
    (status,) = [a.status for a in status_actions(paused, snap3, now, {})]
    assert status.reason == (
        f"suspended: 1 replicas keep their placement, engines stopped: {CPU_VLLM}"
    )


def test_the_pass_learns_from_the_engine_which_profiles_cannot_suspend() -> None:
    def launch(**kw: object) -> str:
        fields = {"name": "p", "engine": "vllm", "model_path": "/m", **kw}
        return launch_of("p", "x", lambda: EngineProfile.model_validate(fields)).suspend_refusal

    assert launch(gpu_class="cpu", threads=2) == CPU_VLLM
    assert launch(gpu_class="h100", args=["--enable-sleep-mode"]) == ""
    assert "--enable-sleep-mode" in launch(gpu_class="h100")
    assert launch(engine="sim", gpu_class="cpu") == ""  # the simulator suspends
