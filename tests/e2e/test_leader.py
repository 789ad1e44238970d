"""Two control planes on one database: exactly one reconciles; `kill -9` it and the other takes
over within seconds; a leader cut off from Postgres while paused (SIGSTOP, its sessions ended
as a partition would end them) can never apply once it wakes: no action row carries its epoch
after the takeover, and it notices it lost the lock.

The nodes here are rows, not agents (the reconciler only reads what agents write): the test is
about who writes plans, and shards that never start keep every pass busy enough to act.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.fleet_harness import ControlPlaneProc, Fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

# Rows-only nodes never sync again: keep them "alive" for the whole test.
_LONG_GRACE = {"LLMGW_CONTROLPLANE__RECONCILE__NODE_GRACE_S": "600"}


def _seed_nodes(f: Fleet, count: int, gpus: int) -> None:
    inventory = json.dumps(
        {
            "gpus": [
                {"index": i, "uuid": f"SIM-{i}", "name": "sim", "gpu_class": "sim"}
                for i in range(gpus)
            ],
            "cpu_threads": 8,
            "source": "sim",
        }
    )
    for i in range(count):
        (node,) = f.sql(
            "INSERT INTO nodes (name, approval_state) VALUES (%s, 'approved') RETURNING id",
            f"row-node-{i}",
        )[0]
        f.sql(
            "INSERT INTO node_status (node_id, mgmt_addr, inventory, last_sync_at) "
            "VALUES (%s, '127.0.0.1', %s, now() + interval '1 hour')",
            node,
            inventory,
        )


def _leaders(cps: list[ControlPlaneProc]) -> list[ControlPlaneProc]:
    return [c for c in cps if c.alive() and c.leads()]


def _epochs(f: Fleet) -> list[tuple[int, int]]:
    return [
        (int(i), int(e)) for i, e in f.sql("SELECT id, epoch FROM reconcile_actions ORDER BY id")
    ]


def _client_ports(pid: int) -> set[int]:
    """Local TCP ports of the process's sockets: how Postgres sees its sessions (client_port)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_one_leader_takeover_on_kill9_and_a_fenced_ex_leader_never_applies(
    sim_fleet: Fleet,
) -> None:
    f = sim_fleet
    _seed_nodes(f, count=4, gpus=4)
    a = f.start_controlplane("cp-a", env=_LONG_GRACE)
    b = f.start_controlplane("cp-b", env=_LONG_GRACE)
    cps = [a, b]
    f.sim_deployment("chat", replicas=2)
    f.until(lambda: len(_leaders(cps)) == 1, timeout_s=15, what="one leader")
    f.until(lambda: len(_epochs(f)) >= 2, timeout_s=15, what="the leader's first actions")

    # Exactly one leads, sample after sample, and every action carries its one epoch.
    for _ in range(10):
        assert len(_leaders(cps)) == 1
        time.sleep(0.1)
    (leader,) = _leaders(cps)
    standby = b if leader is a else a
    assert standby.metric("llmgw_reconcile_passes_total") in (None, 0.0)
    (epoch1,) = {e for _, e in _epochs(f)}
    assert f.sql("SELECT epoch FROM leader")[0][0] == epoch1

    # kill -9: its lock's session dies with it, the standby takes over within seconds.
    killed_at = time.monotonic()
    leader.kill9()
    f.until(lambda: standby.leads(), timeout_s=10, what="the standby to take over")
    takeover_s = time.monotonic() - killed_at
    assert takeover_s < 5, takeover_s
    f.admin("POST", "/deployments/chat/scale", {"replicas": 3})
    f.until(
        lambda: any(e > epoch1 for _, e in _epochs(f)), timeout_s=10, what="the new leader acting"
    )
    epoch2 = max(e for _, e in _epochs(f))

    # A third control plane waits as standby; the leader is paused and cut off from Postgres.
    c = f.start_controlplane("cp-c", env=_LONG_GRACE)
    assert not c.leads()
    old = standby
    old.signal(signal.SIGSTOP)
    try:
        ports = _client_ports(old.proc.pid)
        cut = f.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE client_port = ANY(%s)",
            list(ports),
        )
        assert cut, "the paused leader had no sessions to end"
        f.until(lambda: c.leads(), timeout_s=15, what="cp-c to take over")
        (epoch3,) = f.sql("SELECT epoch FROM leader")[0]
        assert epoch3 > epoch2
        f.admin("POST", "/deployments/chat/scale", {"replicas": 4}, via=c)
        f.until(lambda: any(e == epoch3 for _, e in _epochs(f)), timeout_s=10, what="cp-c acting")
    finally:
        old.signal(signal.SIGCONT)
    first_new = min(i for i, e in _epochs(f) if e == epoch3)

    # The woken ex-leader finds its lock gone and says so; it never leads again while cp-c does.
    f.until(
        lambda: '"leader_lost"' in old.log_text() or '"reconcile_fenced"' in old.log_text(),
        timeout_s=15,
        what="the ex-leader to notice it lost the lock",
    )
    f.until(lambda: old.metric("llmgw_reconcile_leader") == 0.0, timeout_s=10, what="gauge 0")
    f.admin("POST", "/deployments/chat/scale", {"replicas": 5}, via=c)
    f.until(
        lambda: f.sql("SELECT count(*) FROM replicas WHERE state = 'active'")[0][0] == 5,
        timeout_s=10,
        what="five replicas",
    )
    for _ in range(5):
        assert _leaders([old, c]) == [c]
        time.sleep(0.1)
    late = [(i, e) for i, e in _epochs(f) if i >= first_new and e != epoch3]
    assert late == [], f"actions after the takeover with another epoch: {late}"
    assert f.sql("SELECT epoch FROM leader")[0][0] == epoch3
