"""A fingerprint-changing profile edit rolls the replicas within the rollout policy while the
model keeps answering: surge first where a GPU is free, in place within max_unavailable on
a full fleet (and the status and action record say why).

"Keeps answering" is sampled all through the rollout: at every sample, the replicas that
are active and reported ready number at least desired - max_unavailable, and each of them
answers a completion through its agent's proxy (unless it left the active set in the
meantime, which a second read of the database tells).
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.fleet_harness import SIM_ARGS, Fleet, ReadyShard, answers

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def _roll_and_watch(
    f: Fleet, *, desired: int, max_unavailable: int, max_live: int, timeout_s: float
) -> tuple[list[ReadyShard], int, set[str]]:
    """Edit the profile's args, then sample until every ready replica runs the new
    fingerprint. Returns the final ready shards, the number of samples taken and the
    status reasons seen on the way."""
    before = f.ready_shards("chat")
    old_fp = before[0].fingerprint
    version = f.admin("GET", "/profiles/chat")["version"]
    f.admin("PATCH", "/profiles/chat", {"version": version, "args": [*SIM_ARGS, "--seed", "7"]})
    new_fp = f.sql("SELECT fingerprint FROM profiles WHERE name = 'chat'")[0][0]
    assert new_fp != old_fp

    samples = 0
    reasons: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        f.check_alive()
        ready = f.ready_shards("chat")
        up = [s for s in ready if answers(s, "chat")]
        if len(up) < len(ready):
            still_active = {s.shard_id for s in f.ready_shards("chat")}
            lost = [s for s in ready if s not in up and s.shard_id in still_active]
            assert not lost, f"ready replicas did not answer: {lost}\n{f.diagnose()}"
        assert len(ready) >= desired - max_unavailable, (
            f"only {len(ready)} ready replicas during the rollout (desired {desired}, "
            f"max_unavailable {max_unavailable})\n{f.diagnose()}"
        )
        # Never more active replicas than desired + max_surge. Draining ones are not counted,
        # as Kubernetes does not count terminating pods: they leave within the drain timeout.
        active = [s for s in f.live_shards("chat") if s[1] == "active"]
        assert len(active) <= max_live, f.diagnose()
        samples += 1
        reasons.update(r for (r,) in f.sql("SELECT reason FROM deployment_status"))
        if len(ready) == desired and all(s.fingerprint == new_fp for s in ready):
            leftovers = [s for s in f.live_shards("chat") if s[1] != "active"]
            if not leftovers:
                return ready, samples, reasons
        assert time.monotonic() < deadline, f"rollout not done in {timeout_s}s\n{f.diagnose()}"
        time.sleep(0.05)


def test_a_rollout_surges_first_and_keeps_the_model_answering(sim_fleet: Fleet) -> None:
    f = sim_fleet
    f.start_controlplane("cp-a")
    f.start_agent("node-a", gpus=2)
    f.start_agent("node-b", gpus=2)
    f.sim_deployment("chat", replicas=2, max_surge="1", max_unavailable="0")
    before = f.wait_ready("chat", 2, timeout_s=45)
    after, samples, _ = _roll_and_watch(f, desired=2, max_unavailable=0, max_live=3, timeout_s=45)
    assert samples > 5
    assert not {s.shard_id for s in after} & {s.shard_id for s in before}
    acts = f.sql("SELECT action, reason FROM reconcile_actions ORDER BY id")
    surges = [r for a, r in acts if a == "CreateReplica" and "surge" in r]
    assert len(surges) == 2, acts
    assert not any("in place" in r for _, r in acts), acts
    status = f.admin("GET", "/deployments/chat")["status"]
    assert status["updated_replicas"] == 2 and status["ready_replicas"] == 2, status


def test_a_full_fleet_is_replaced_in_place_within_max_unavailable(sim_fleet: Fleet) -> None:
    f = sim_fleet
    f.start_controlplane("cp-a")
    f.start_agent("node-a", gpus=1)
    f.start_agent("node-b", gpus=1)
    f.sim_deployment("chat", replicas=2, max_surge="1", max_unavailable="1")
    f.wait_ready("chat", 2, timeout_s=45)
    _, _, reasons = _roll_and_watch(f, desired=2, max_unavailable=1, max_live=2, timeout_s=45)
    # The status says why the rollout goes in place while it does.
    assert any("no capacity for a surge replica" in r for r in reasons), reasons
    acts = f.sql("SELECT action, reason FROM reconcile_actions ORDER BY id")
    in_place = [r for a, r in acts if "in place within max_unavailable 1" in r]
    assert in_place, acts
    assert any("no capacity for a surge replica" in r for r in in_place), acts
