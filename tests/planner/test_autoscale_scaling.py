"""scaling: the leader's demand history and the autoscaler's pass over a snapshot (pure)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from llmgw.planner.autoscale import AutoscalePolicy, ScaleState
from llmgw.planner.scaling import DemandHistory, ModelSignal, scale_snapshot
from llmgw.planner.snapshot import DeploymentId, RolloutStatus
from tests.planner.planner_testkit import T0, deployment, node, run_until_settled, snapshot

POLICY = AutoscalePolicy(min_replicas=0, max_replicas=4, target_waiting_requests=2,
                         scale_up_window_s=0)  # fmt: skip
D = DeploymentId("d")


def _signal(waiting: int = 0, gateways: int = 1, held: int = 0) -> ModelSignal:
    return ModelSignal(gateways, waiting, 0, 0, 0, held)


def test_history_knows_silence_from_idleness_and_forgets_old_samples() -> None:
    h = DemandHistory(keep_s=10)
    h.record(T0, {"a", "b"}, {"a": _signal(3)})
    # b had no row while a gateway reported a: it was idle, and that is known.
    assert [s.known for s in h.of("b")] == [True]
    h.record(T0 + timedelta(seconds=1), {"a", "b"}, {})
    assert h.of("a")[-1].known is False  # nobody reported: nothing is known
    h.record(T0 + timedelta(seconds=20), {"a"}, {"a": _signal(1)})
    assert [s.waiting_requests for s in h.of("a")] == [1]  # older than keep_s: gone
    assert h.of("b") == ()  # a model no longer autoscaled is forgotten


def test_pass_counts_ready_replicas_freezes_on_a_stall_and_skips_suspended() -> None:
    d = deployment("d", 1, autoscale=POLICY, warm_replicas=1)
    snap, now, _ = run_until_settled(snapshot([d], [node("n1", 4)]), T0)
    h = DemandHistory()
    h.record(now, {"m"}, {"m": _signal(waiting=8)})
    state = {D: ScaleState(1, 1)}
    out, decisions = scale_snapshot(snap, history=h, served={D: "m"}, state=state, broken={},
                                    now=now)  # fmt: skip
    assert decisions[D].desired == 2  # 8 waiting / 2 per replica, one step from 1
    assert out.deployments[0].replicas == 2 and out.deployments[0].warm_replicas == 2
    # The new replica is not serving yet (ready 1 < desired 2): the next pass waits.
    _, again = scale_snapshot(out, history=h, served={D: "m"},
                              state={D: ScaleState(2, 2, last_scaled_at=now - timedelta(1))},
                              broken={}, now=now)  # fmt: skip
    assert again[D].changed is False
    stalled = replace(
        snap,
        deployments=(replace(snap.deployments[0], status=RolloutStatus(stalled=True, reason="x")),),
    )
    _, frozen = scale_snapshot(stalled, history=h, served={D: "m"}, state=state, broken={},
                               now=now)  # fmt: skip
    assert frozen[D].reason == "scaling frozen: rollout stalled: x"
    _, broken = scale_snapshot(snap, history=h, served={D: "m"}, state=state,
                               broken={D: "bad args"}, now=now)  # fmt: skip
    assert broken[D].reason.startswith("scaling frozen: profile cannot be launched")
    paused = replace(snap, deployments=(replace(snap.deployments[0], suspended=True),))
    _, none = scale_snapshot(paused, history=h, served={D: "m"}, state=state, broken={}, now=now)
    assert none == {}
