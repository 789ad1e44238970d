"""An agent that stops syncing has its shards replaced on another node, after the grace period
and not before; when it comes back, it stops the engine it no longer should run."""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime

import pytest

from tests.e2e.fleet_harness import NODE_GRACE_S, SYNC_S, Fleet, answers, pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def test_a_stopped_agents_replica_is_replaced_after_the_grace_period(sim_fleet: Fleet) -> None:
    f = sim_fleet
    f.start_controlplane("cp-a")
    f.start_agent("node-a", gpus=1)
    f.start_agent("node-b", gpus=1)
    f.sim_deployment("chat", replicas=1)
    (first,) = f.wait_ready("chat", 1, timeout_s=45)
    lost_node = first.node
    other = "node-b" if lost_node == "node-a" else "node-a"
    agent = f.agents[lost_node]
    assert agent.proc is not None

    os.kill(agent.proc.pid, signal.SIGSTOP)
    stopped_at = datetime.now(UTC)
    try:
        replacement = f.until(
            lambda: [s for s in f.ready_shards("chat") if s.node == other],
            timeout_s=30,
            what=f"a replacement replica on {other}",
        )[0]
        # Not before the grace period: the node's last sync was at most one period before the stop.
        (created_at,) = f.sql(
            "SELECT at FROM reconcile_actions WHERE action = 'CreateReplica' AND node = %s "
            "AND replica_id = %s::uuid",
            other,
            replacement.replica_id,
        )[0]
        assert (created_at - stopped_at).total_seconds() >= NODE_GRACE_S - 2 * SYNC_S
        reasons = [
            r for (r,) in f.sql("SELECT reason FROM reconcile_actions WHERE node = %s", lost_node)
        ]
        assert any("sync" in r for r in reasons), reasons
        assert answers(replacement, "chat")
        # The engine on the silent node still runs (nobody can reach it to stop it) ...
        assert pid_alive(first.pid)
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
    # ... until its agent syncs again, learns the shard is no longer desired, and stops it.
    f.until(lambda: not pid_alive(first.pid), timeout_s=20, what="the replaced engine to stop")
    # Released (its GPU free), and then deleted with its replica: either way, not live.
    f.until(
        lambda: all(
            r[0] for r in f.sql("SELECT released FROM shards WHERE id = %s", first.shard_id)
        ),
        timeout_s=20,
        what="the replaced shard's release",
    )
    assert [s.shard_id for s in f.ready_shards("chat")] == [replacement.shard_id]
    assert f.held_gpus() == 1
