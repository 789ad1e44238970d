"""Autoscaling end to end, all real processes: two control planes (each a gateway, one the
leader), an agent with simulator engines.

An autoscaled deployment idle past `suspend_after_s` has its replica suspended (kept placed,
not counted ready), past `zero_after_s` stopped: zero replicas. Then a request reaches each
gateway at once: both are held, the leader is woken and starts one replica, not two, with
its reason in the action record; `kill -9` of the leader right after that decision leaves
the fleet at one replica (the decision and its replica were written in one fenced
transaction, and the new leader converges on the stored count), and the request held by the
surviving gateway is answered.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.e2e.fleet_harness import Fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

POLICY = {
    "min_replicas": 0,
    "max_replicas": 2,
    "target_waiting_requests": 4,
    "scale_up_window_s": 30,
    "scale_down_window_s": 1,
    "suspend_after_s": 5,
    "zero_after_s": 8,
}


def _suspended(f: Fleet) -> int:
    return int(
        f.sql(
            "SELECT count(*) FROM shards s JOIN replicas r ON r.id = s.replica_id "
            "WHERE s.desired_state = 'suspended' AND NOT s.released AND r.state = 'active'"
        )[0][0]
    )


def test_idle_to_zero_then_two_gateways_wake_one_replica_through_a_leader_kill(
    sim_fleet: Fleet,
) -> None:
    f = sim_fleet
    # The agent syncs with the one that does not lead: the kill below is about the leader's
    # decision, not about an agent finding another control plane.
    first = f.start_controlplane("cp-a")
    f.until(first.leads, timeout_s=20, what="cp-a to lead")
    cps = [first, f.start_controlplane("cp-b")]
    f.start_agent("node-a", gpus=2, via=cps[1])
    f.sim_deployment("chat", replicas=1)
    version = f.admin("GET", "/deployments/chat")["version"]
    out = f.admin("PATCH", "/deployments/chat", {"version": version, "autoscale": POLICY})
    assert out["autoscale"]["zero_after_s"] == 8
    # Up once: ready, or already suspended (on a loaded host a slow start can use up the
    # idle window, and the replica is suspended as it becomes ready).
    f.until(
        lambda: (
            _suspended(f) == 1
            or f.admin("GET", "/deployments/chat")["status"]["ready_replicas"] == 1
        ),
        timeout_s=40,
        what="the replica up (ready or suspended)",
    )

    # Idle: suspended first (placement kept, not ready), then stopped.
    f.until(lambda: _suspended(f) == 1, timeout_s=20, what="the idle replica suspended")
    f.until(
        lambda: (
            (st := f.admin("GET", "/deployments/chat")["status"])["suspended_replicas"] == 1
            and st["ready_replicas"] == 0
        ),
        timeout_s=10,
        what="status to count one suspended, none ready",
    )
    f.until(lambda: not f.live_shards("chat"), timeout_s=20, what="scaled to zero")
    scaled = f.admin("GET", "/deployments/chat")["autoscale_status"]
    assert scaled["desired_replicas"] == 0 and scaled["warm_replicas"] == 0
    (mark,) = f.sql("SELECT max(id) FROM reconcile_actions")[0]

    key = f.admin("POST", "/keys", {"name": "client"})["key"]
    answers: dict[str, int | str] = {}

    def ask(cp_name: str, url: str) -> None:
        try:
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": "chat",
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 4,
                },
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            answers[cp_name] = (
                r.status_code if r.status_code == 200 else f"{r.status_code} {r.text}"
            )
        except httpx.HTTPError as exc:  # the gateway killed with its leader
            answers[cp_name] = type(exc).__name__

    threads = [threading.Thread(target=ask, args=(c.name, c.public_url)) for c in cps]
    for t in threads:
        t.start()
    woken = f.until(
        lambda: f.sql(
            "SELECT reason FROM reconcile_actions WHERE id > %s AND action = 'Autoscale' "
            "AND reason LIKE 'scaled 0%%'",
            mark,
        ),
        timeout_s=20,
        what="the leader woken by the held requests",
    )
    assert "woken" in woken[0][0] and "held with no ready replica" in woken[0][0], woken
    leader = f.until(lambda: next((c for c in cps if c.leads()), None), timeout_s=5, what="leader")
    assert leader is first
    leader.kill9()
    survivor = next(c for c in cps if c is not leader)
    for t in threads:
        t.join(timeout=60)
    assert answers[survivor.name] == 200, answers
    f.until(survivor.leads, timeout_s=20, what="the survivor to lead")
    # Several passes of the new leader later: still exactly one replica, created once.
    passes = survivor.metric("llmgw_reconcile_passes_total") or 0
    f.until(
        lambda: (survivor.metric("llmgw_reconcile_passes_total") or 0) >= passes + 5,
        timeout_s=15,
        what="five passes of the new leader",
    )
    assert len(f.live_shards("chat")) == 1
    creates = f.sql(
        "SELECT count(*) FROM reconcile_actions WHERE id > %s AND action = 'CreateReplica'", mark
    )[0][0]
    assert creates == 1
    assert f.admin("GET", "/deployments/chat")["autoscale_status"]["desired_replicas"] == 1
