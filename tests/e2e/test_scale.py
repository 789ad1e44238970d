"""Scaling a deployment end to end: control plane, agents and simulator engines, all real.

0 -> 3: the reconciler places three replicas, agents start their engines, the shards are
reported ready and each engine answers through its agent's proxy with the key the
control plane gave it. 3 -> 1: two replicas drain and stop, their engine processes are
gone and their GPUs are released. A description edit (same fingerprint) restarts nothing.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.fleet_harness import Fleet, answers, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def test_scale_0_to_3_to_1_and_a_description_edit_restarts_nothing(sim_fleet: Fleet) -> None:
    f = sim_fleet
    f.start_controlplane("cp-a")
    f.start_agent("node-a", gpus=2)
    f.start_agent("node-b", gpus=2)
    f.sim_deployment("chat", replicas=0)

    # Nothing desired, nothing placed (the reconciler has seen the deployment: status written).
    f.until(lambda: f.sql("SELECT 1 FROM deployment_status"), timeout_s=10, what="a first pass")
    assert f.live_shards() == []

    f.admin("POST", "/deployments/chat/scale", {"replicas": 3})
    ready = f.wait_ready("chat", 3, timeout_s=45)
    assert len({s.replica_id for s in ready}) == 3
    # Spread over both nodes (2 GPUs each), each GPU held once.
    assert {s.node for s in ready} == {"node-a", "node-b"}
    assert f.held_gpus() == 3
    for shard in ready:
        r = httpx.get(
            f"{shard.proxy_url}/health",
            headers={"Authorization": f"Bearer {shard.key}"},
            timeout=5,
        )
        assert r.status_code == 200, r.text
        # The proxy demands the shard's own key.
        r = httpx.get(f"{shard.proxy_url}/health", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        assert answers(shard, "chat")
        assert pid_alive(shard.pid)

    # The status is the reconciler's, written on its next pass after the agents' reports.
    f.until(
        lambda: f.admin("GET", "/deployments/chat")["status"]["ready_replicas"] == 3,
        timeout_s=10,
        what="the rollout status to count 3 ready replicas",
    )

    # Prometheus service discovery: one target group per ready engine, the agent proxy's
    # address, the shard's metrics path behind it; no engine key anywhere in the answer.
    r = httpx.get(f"{f.cp.url}/admin/v1/discovery/prometheus", timeout=5)
    assert r.status_code == 401
    groups = f.admin("GET", "/discovery/prometheus")
    by_shard = {g["labels"]["shard"]: g for g in groups}
    assert set(by_shard) == {s.shard_id for s in ready}
    for shard in ready:
        g = by_shard[shard.shard_id]
        assert shard.key not in str(groups)
        assert g["labels"]["model"] == "chat" and g["labels"]["deployment"] == "chat"
        assert g["labels"]["replica"] == shard.replica_id and g["labels"]["node"] == shard.node
        (target,) = g["targets"]
        url = f"{g['labels']['__scheme__']}://{target}{g['labels']['__metrics_path__']}"
        assert url == f"{shard.proxy_url}/metrics"
        scraped = httpx.get(url, headers={"Authorization": f"Bearer {shard.key}"}, timeout=5)
        assert scraped.status_code == 200 and "# TYPE" in scraped.text, scraped.text[:200]

    # A description is not part of the fingerprint: no engine restarts.
    version = f.admin("GET", "/profiles/chat")["version"]
    f.admin("PATCH", "/profiles/chat", {"version": version, "description": "edited"})
    epoch_actions = f.sql("SELECT count(*) FROM reconcile_actions")[0][0]
    # Let several passes and syncs go by, then compare: same shards, same processes.
    f.until(lambda: f.cp.metric("llmgw_reconcile_passes_total") or 0, timeout_s=5, what="metrics")
    passes = f.cp.metric("llmgw_reconcile_passes_total") or 0
    f.until(
        lambda: (f.cp.metric("llmgw_reconcile_passes_total") or 0) >= passes + 5,
        timeout_s=10,
        what="five more passes",
    )
    after = f.ready_shards("chat")
    assert [(s.shard_id, s.pid) for s in after] == [(s.shard_id, s.pid) for s in ready]
    assert f.sql("SELECT count(*) FROM reconcile_actions")[0][0] == epoch_actions

    # 3 -> 1: two replicas drain, stop, and their engines and GPUs are gone.
    f.admin("POST", "/deployments/chat/scale", {"replicas": 1})

    def scaled_down() -> bool:
        live = f.live_shards("chat")
        return len(live) == 1 and live[0][1] == "active"

    f.until(scaled_down, timeout_s=30, what="two replicas drained and released")
    kept = f.live_shards("chat")[0][0]
    gone = [s for s in ready if s.shard_id != kept]
    assert len(gone) == 2
    f.until(
        lambda: not any(pid_alive(s.pid) for s in gone),
        timeout_s=10,
        what="the removed engines' processes to exit",
    )
    assert f.held_gpus() == 1
    # Drained first, then stopped: the action record says so, with the reason.
    acts = [a for (a,) in f.sql("SELECT action FROM reconcile_actions ORDER BY id")]
    assert acts.count("CreateReplica") == 3
    assert acts.count("DrainReplica") == 2, acts
    assert acts.index("DrainReplica") < acts.index("StopReplica"), acts
    survivor = next(s for s in ready if s.shard_id == kept)
    assert answers(survivor, "chat")
    assert [g["labels"]["shard"] for g in f.admin("GET", "/discovery/prometheus")] == [kept]
    f.until(
        lambda: f.admin("GET", "/deployments/chat")["status"]["replicas"] == 1,
        timeout_s=10,
        what="status to count one replica",
    )
