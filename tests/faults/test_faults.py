"""The end-to-end fault suite (issue #12): kill -9, in turn, one engine, the agent, the leader
control plane and Postgres, under steady load from the official `openai` client.

The world: a Postgres of the suite's own (killable), two `llmgw controlplane` processes on it
(cp-a leads; the agent syncs with cp-b, as one behind a load balancer would reach any of them),
one `llmgw agent --sim-gpus 2` running a deployment of two `sim` replicas with kv_events, a key
per phase, and four client workers (half the requests streaming) that reach the two gateways
through a client-side balancer: stick to one gateway, and when a connection to it cannot be
made, send the request once to the other (nothing was sent, so nothing ran twice).

For each fault the test asserts, and docs/fault-tolerance.md states for operators:
- which requests may fail: those in flight at the killed component; every request started
  after that must succeed. Killing the agent fails none: each shard's front door (its
  authenticating proxy) is served by the shard's own wrapper, and the restarted agent adopts
  the engines and reports the same proxy URLs;
- which engines restart: the killed one only (engine pids before and after);
- what is kept: keys and desired state unchanged; usage equal to what the clients saw, less
  at most what the killed gateway served in its last flush interval, plus at most what failed
  requests could have been billed;
- how long until the fleet is back to desired (both replicas ready), against the bounds below;
- that routing is precise again after the fault, on every gateway (the control plane's
  ``llmgw_prefix_decisions_total{method="precise"}`` grows, on a restarted one from zero).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.fleet_harness import ControlPlaneProc, answers, pid_alive
from tests.faults.fault_harness import (
    Call,
    FaultFleet,
    KillablePostgres,
    Load,
    ShardStates,
    precise_decisions,
    running,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "chat"
REPLICAS = 2
SIM_ARGS = ["--time-scale", "0.05", "--num-blocks", "2048"]

# The bounds docs/fault-tolerance.md states, with this suite's periods (agent sync 0.3 s,
# health 0.2 s, restart backoff from 0.3 s, reconcile tick 0.3 s). Seconds from the kill.
ENGINE_BACK_S = 20.0  # the killed engine restarted by its agent and ready again
AGENT_BACK_S = 20.0  # a restarted agent serving its (adopted) engines again
LEADER_TAKEOVER_S = 10.0  # another control plane leads
POSTGRES_BACK_S = 30.0  # after Postgres is back: a leader, agents syncing, fleet ready
PRECISE_AGAIN_S = 30.0  # precise decisions on every gateway, a restarted one included
# Starting a control plane process (imports, migrations check, listeners) on two busy cores.
CP_START_S = 60.0
# A node is declared lost (its shards replaced elsewhere) after this long without a sync.
# The e2e harness's 2 s is shorter than a Python agent takes to restart on two busy cores.
NODE_GRACE_S = 10.0
CP_ENV = {"LLMGW_CONTROLPLANE__RECONCILE__NODE_GRACE_S": str(NODE_GRACE_S)}
# Usage recorded by a gateway is in Postgres within its flush interval (1 s) plus a commit;
# seconds on two busy cores.
USAGE_FLUSH_S = 10.0
# What a killed gateway may lose (accounting.py): what it recorded in its last flush interval
# (1 s) and did not commit, with the flush in progress allowed a second to commit.
USAGE_LOSS_WINDOW_S = 2.0


@dataclass
class Phase:
    name: str
    t_kill: float = 0.0  # just before the signal
    t_back: float = 0.0  # the component is dead and back or routed around: requests started
    # from here on must all succeed
    t_end: float = 0.0  # the phase's checks done; the next phase starts
    killed_gateway: str = ""  # the gateway whose in-flight requests may fail, if any
    no_failures: bool = False  # not one request may fail, in flight at the kill or not
    figures: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[FaultFleet, KillablePostgres]]:
    pg = KillablePostgres()
    url = pg.start()
    fleet = FaultFleet(db_url=url, tmp=tmp_path)
    try:
        yield fleet, pg
    finally:
        if pg.pg.pid is None:  # a failure while it was down: close needs it for the shard ids
            pg.restart()
        fleet.close()
        pg.stop()


def test_kill_9_in_turn_engine_agent_leader_postgres(
    world: tuple[FaultFleet, KillablePostgres],
) -> None:
    fleet, pg = world
    began = time.monotonic()
    cp_a = fleet.start_controlplane("cp-a", **CP_ENV)
    fleet.until(lambda: cp_a.leads(), timeout_s=30, what="cp-a to lead")
    cp_b = fleet.start_controlplane("cp-b", **CP_ENV)
    agent = fleet.start_agent_at("node-a", gpus=REPLICAS, controlplane=cp_b)
    fleet.sim_kv_deployment(MODEL, replicas=REPLICAS, args=SIM_ARGS)
    fleet.until(lambda: _fleet_ready(fleet), timeout_s=90, what="both replicas ready")
    keys = {
        name: (name, fleet.create_key(name))
        for name in ("warm", "engine", "agent", "leader", "postgres")
    }
    gateways = [("cp-a", fleet.public["cp-a"]), ("cp-b", fleet.public["cp-b"])]
    load = Load(lambda: gateways, model=MODEL, key=keys["warm"])
    setup_s = time.monotonic() - began
    phases: list[Phase] = []
    kills: list[GatewayKill] = []

    with running(load), running(ShardStates(fleet)) as states:
        # Warm: requests flow through both gateways and both decide precisely.
        for cp in (cp_a, cp_b):

            def deciding(cp: ControlPlaneProc = cp) -> bool:
                return precise_decisions(cp, MODEL) > 0

            fleet.until(deciding, timeout_s=PRECISE_AGAIN_S, what=f"precise decisions on {cp.name}")
        keys_before = fleet.desired_state()

        # --- 1. one engine -------------------------------------------------------------
        victim = fleet.ready_shards(MODEL)[0]

        def kill_engine(ph: Phase) -> None:
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: not pid_alive(victim.pid), timeout_s=10, what="the engine to die")
            ph.t_back = time.monotonic()  # the gateway retries a refused connection elsewhere

        def engine_back() -> bool:
            pids = fleet.shard_pids(MODEL)
            return _fleet_ready(fleet) and pids.get(victim.shard_id, victim.pid) != victim.pid

        phases.append(
            _phase(
                fleet,
                load,
                keys["engine"],
                "engine",
                kill_engine,
                engine_back,
                bound_s=ENGINE_BACK_S,
                restarted={victim.shard_id},
                previous="warm",
                kills=kills,
                gateways=[cp_a, cp_b],
            )
        )

        # --- 2. the agent --------------------------------------------------------------
        # Each shard's front door is served by its own wrapper, not the agent: nothing a client
        # sends may fail while the agent is dead (t_back is the kill itself), and the restarted
        # agent adopts the engines and reports the front doors where they were.
        doors = {s.shard_id: s.proxy_url for s in fleet.ready_shards(MODEL)}

        def kill_agent(ph: Phase) -> None:
            agent.kill9()
            ph.t_back = ph.t_kill
            ph.no_failures = True
            # Served with no agent at all: requests sent after the kill succeed before any
            # agent runs again.
            wait_until(
                lambda: load.successes_after(ph.t_kill, "agent") >= 8,
                timeout_s=20,
                what="requests to succeed while the agent is dead",
            )
            ph.figures["served_while_down"] = load.successes_after(ph.t_kill, "agent")
            ph.figures["down_s"] = round(time.monotonic() - ph.t_kill, 2)
            # Then systemd's Restart=always: the new agent adopts the running engines.
            fleet.restart_agent("node-a")
            wait_until(
                lambda: (
                    all(answers(s, MODEL) for s in fleet.ready_shards(MODEL))
                    and len(fleet.ready_shards(MODEL)) == REPLICAS
                ),
                timeout_s=AGENT_BACK_S,
                what="every engine ready and answering under the restarted agent",
            )
            after = {s.shard_id: s.proxy_url for s in fleet.ready_shards(MODEL)}
            assert after == doors, f"front doors moved: {doors} -> {after}"

        phases.append(
            _phase(
                fleet,
                load,
                keys["agent"],
                "agent",
                kill_agent,
                lambda: _fleet_ready(fleet),
                bound_s=AGENT_BACK_S,
                restarted=set(),
                previous="engine",
                kills=kills,
                gateways=[cp_a, cp_b],
            )
        )

        # --- 3. the leader control plane -----------------------------------------------
        assert fleet.leader() is cp_a, "cp-a should still lead"
        restarted_cp: list[ControlPlaneProc] = []

        def kill_leader(ph: Phase) -> None:
            cp_a.signal(signal.SIGKILL)
            cp_a.proc.wait(timeout=10)
            ph.t_back = time.monotonic()  # the client balancer sends new requests to cp-b
            ph.killed_gateway = "cp-a"
            kills.append(("cp-a", ph.t_kill, ph.t_back))
            took = wait_until(
                lambda: cp_b.leads(), timeout_s=LEADER_TAKEOVER_S, what="cp-b to take over"
            )
            ph.figures["takeover_s"] = round(took - ph.t_kill, 2)
            # ... and cp-a comes back (systemd again), as a follower with an empty index.
            restarted_cp.append(fleet.start_controlplane("cp-a", **CP_ENV))
            ph.figures["cp_restarted_s"] = round(time.monotonic() - ph.t_kill, 2)

        phases.append(
            _phase(
                fleet,
                load,
                keys["leader"],
                "leader",
                kill_leader,
                lambda: _fleet_ready(fleet),
                bound_s=LEADER_TAKEOVER_S + CP_START_S,
                restarted=set(),
                previous="agent",
                kills=kills,
                gateways=lambda: [restarted_cp[0], cp_b],
            )
        )
        new_a = restarted_cp[0]
        assert not new_a.leads() and cp_b.leads(), "exactly one leader, the one that took over"

        # --- 4. Postgres ---------------------------------------------------------------
        def kill_postgres(ph: Phase) -> None:
            pg.kill9()
            ph.t_back = time.monotonic()  # nothing a client sends waits on Postgres
            # Serving from memory while it is down: requests started after it died succeed.
            wait_until(
                lambda: load.successes_after(ph.t_back, "postgres") >= 8,
                timeout_s=30,
                what="requests to succeed while Postgres is down",
            )
            ph.figures["served_while_down"] = load.successes_after(ph.t_back, "postgres")
            ph.figures["down_s"] = round(time.monotonic() - ph.t_kill, 2)
            pg.restart()
            ph.figures["pg_restarted_s"] = round(time.monotonic() - ph.t_kill, 2)

        def postgres_back() -> bool:
            synced = fleet.sql(
                "SELECT count(*) FROM node_status WHERE last_sync_at > now() - interval '2 s'"
            )[0][0]
            return bool(synced) and fleet.leader() is not None and _fleet_ready(fleet)

        phases.append(
            _phase(
                fleet,
                load,
                keys["postgres"],
                "postgres",
                kill_postgres,
                postgres_back,
                bound_s=POSTGRES_BACK_S,
                restarted=set(),
                previous="leader",
                kills=kills,
                gateways=[new_a, cp_b],
            )
        )

    # --- nothing recorded lost ---------------------------------------------------------
    assert fleet.desired_state() == keys_before, "keys or desired state changed"
    # The gateways' last flush: SIGTERM flushes what is left (docs/architecture.md §9) before exiting.
    for cp in (new_a, cp_b):
        cp.signal(signal.SIGTERM)
    for cp in (new_a, cp_b):
        assert cp.proc.wait(timeout=30) == 0, cp.log_text()[-3000:]

    report: dict[str, Any] = {"setup_s": round(setup_s, 1)}
    problems: list[str] = []
    for ph in phases:
        calls = load.snapshot(ph.name)
        ph.figures.update(_judge_requests(ph, calls, states, problems))
        ph.figures.update(_judge_usage(fleet, ph, calls, kills, problems))
        report[ph.name] = ph.figures
    report["total_s"] = round(time.monotonic() - began, 1)
    # Not asserted (a known issue, see docs/fault-tolerance.md): how hard each control plane
    # retried the leader lock while Postgres was down.
    report["leader_acquire_failed_logged"] = {
        cp.name: sum(1 for e in cp.events() if e["event"] == "leader_acquire_failed")
        for cp in (new_a, cp_b)
    }
    # Every call, for a post-mortem against the control planes' logs (in the same dir).
    (fleet.tmp / "calls.json").write_text(
        json.dumps([dataclasses.asdict(c) for c in load.snapshot()], indent=0)
    )
    (fleet.tmp / "usage.json").write_text(json.dumps(states.usage))
    (fleet.tmp / "phases.json").write_text(
        json.dumps([dataclasses.asdict(p) for p in phases], indent=1, default=str)
    )
    print("fault suite figures:", json.dumps(report, indent=1))
    assert not problems, "\n".join(problems)


# --- one phase ----------------------------------------------------------------------------


def _phase(
    fleet: FaultFleet,
    load: Load,
    key: tuple[str, str],
    name: str,
    kill: Callable[[Phase], None],
    back: Callable[[], bool],
    *,
    bound_s: float,
    restarted: set[str],
    gateways: list[ControlPlaneProc] | Callable[[], list[ControlPlaneProc]],
    previous: str | None,
    kills: list[GatewayKill],
) -> Phase:
    """Switch the load to this phase's key, kill, restore, and check the fleet and the index.

    The requests themselves are judged at the end, when every call of the phase has finished."""
    ph = Phase(name)
    load.rebalance()
    load.key = key
    switched = time.monotonic()
    fleet.until(
        lambda: (
            load.successes_after(switched, name) >= 8
            and {c.worker for c in load.snapshot(name) if c.started > switched}
            >= set(range(load.workers))
        ),
        timeout_s=30,
        what=f"load on key {name}",
    )
    # Every call of the previous phase has ended: its usage reaches Postgres within the flush
    # bound (and before this phase's kill, so each phase's figures are its own).
    if previous is not None:
        seen, may_lose, _ = _usage_bounds(load.snapshot(previous), kills)
        flushed = wait_until(
            lambda: fleet.usage(previous)[0] >= seen[0] - may_lose[0],
            timeout_s=USAGE_FLUSH_S,
            what=f"the usage of key {previous} in Postgres",
        )
        ph.figures["previous_usage_flushed_s"] = round(flushed - switched, 2)
    pids_before = fleet.shard_pids(MODEL)
    assert len(pids_before) == REPLICAS, pids_before
    ph.t_kill = time.monotonic()
    kill(ph)
    ready_at = wait_until(
        lambda: back(), timeout_s=bound_s, what=f"the fleet back to desired after the {name} kill"
    )
    ph.figures["back_to_desired_s"] = round(ready_at - ph.t_kill, 2)
    ph.figures["bound_s"] = bound_s

    # No engine restarted that did not need to be.
    pids_after = fleet.shard_pids(MODEL)
    assert set(pids_after) == set(pids_before), (pids_before, pids_after)
    changed = {sid for sid in pids_before if pids_after[sid] != pids_before[sid]}
    assert changed == restarted, f"engines restarted: {changed}, expected {restarted}"
    assert all(pid_alive(pid) for pid in pids_after.values()), pids_after

    # Requests started after recovery succeed (judged at the end), and there are some.
    fleet.until(
        lambda: load.successes_after(ready_at, name) >= 8,
        timeout_s=30,
        what=f"requests to succeed after the {name} kill",
    )
    live_cps = gateways() if callable(gateways) else gateways
    # The precise index rebuilt: every live control plane holds a complete view of every
    # shard, and of a restarted engine's new blocks (requests with prompts nobody holds go to
    # the least-loaded replica, so some land on it).
    for cp in live_cps:
        for sid in pids_after:

            def rebuilt(cp: ControlPlaneProc = cp, sid: str = sid) -> bool:
                view = fleet.kv_view(cp, sid)
                if view is None or not view["complete"] or view["partial"]:
                    return False
                if sid in restarted and view["num_blocks"] == 0:
                    load.probe(
                        (cp.name, fleet.public[cp.name]), system=f"novel {time.time()} " * 40
                    )
                    return False
                return True

            t = wait_until(
                rebuilt, timeout_s=PRECISE_AGAIN_S, what=f"{cp.name}'s index of shard {sid}"
            )
            ph.figures[f"index_complete_{cp.name}_s"] = round(t - ph.t_kill, 2)
    # Precise decisions again on every gateway.
    for cp in live_cps:
        before = precise_decisions(cp, MODEL)
        # Probed directly too: the balancer may have moved every worker off this gateway.
        probe_gw = [(cp.name, fleet.public[cp.name])]

        def grew(
            cp: ControlPlaneProc = cp, before: float = before, probe_gw: list[Any] = probe_gw
        ) -> bool:
            for gw in probe_gw:
                load.probe(gw)
            return precise_decisions(cp, MODEL) > before

        t = wait_until(grew, timeout_s=PRECISE_AGAIN_S, what=f"precise decisions on {cp.name}")
        ph.figures[f"precise_again_{cp.name}_s"] = round(t - ph.t_kill, 2)
    ph.t_end = time.monotonic()
    return ph


def _fleet_ready(fleet: FaultFleet) -> bool:
    return len(fleet.ready_shards(MODEL)) == REPLICAS


# --- judging ------------------------------------------------------------------------------


def _judge_requests(
    ph: Phase, calls: list[Call], states: ShardStates, problems: list[str]
) -> dict[str, Any]:
    failed = [c for c in calls if not c.ok]
    # A ready shard without a proxy URL is one the gateways cannot route to (the agent's first
    # sync after a restart used to report its adopted engines so).
    unroutable = [
        f"  {ts - ph.t_kill:+.2f}s {sid} {state}"
        for ts, sid, state in states.transitions
        if ph.t_kill < ts < ph.t_end and state.startswith("ready") and state.endswith("url=")
    ]
    if unroutable:
        problems.append(
            f"{ph.name}: ready shards reported with no proxy URL:\n" + "\n".join(unroutable)
        )
    if ph.no_failures and failed:
        problems.append(
            f"{ph.name}: {len(failed)} of {len(calls)} requests failed, none may: "
            + "; ".join(sorted({c.error[:120] for c in failed}))
        )
    in_flight = [c for c in calls if c.started < ph.t_back and c.ended > ph.t_kill]
    if ph.killed_gateway:
        in_flight = [c for c in in_flight if c.gateway == ph.killed_gateway]
    # The rule: a request may fail only if it was in flight at the killed component, or
    # started before the component was back; all others must have succeeded.
    beyond = [
        c
        for c in failed
        if not (
            c.started < ph.t_back
            and c.ended > ph.t_kill
            and (not ph.killed_gateway or c.gateway == ph.killed_gateway)
        )
    ]
    if beyond:
        problems.append(
            f"{ph.name}: failures beyond the rule:\n"
            + "\n".join(
                f"  started {c.started - ph.t_kill:+.2f}s ended {c.ended - ph.t_kill:+.2f}s "
                f"at {c.gateway} stream={c.stream}: {c.error}"
                for c in beyond
            )
            + f"\nshard states around the kill:\n{states.around(ph.t_kill)}"
        )
    return {
        "requests": len(calls),
        "failed": len(failed),
        "at_risk": len(in_flight),  # in flight at the kill, or sent while it was down
        "failed_over_by_client": sum(1 for c in calls if c.failed_over),
        "failure_kinds": sorted({c.error.split(":")[0] for c in failed}),
        "slowest_failure_s": round(max((c.ended - c.started for c in failed), default=0.0), 2),
    }


GatewayKill = tuple[str, float, float]  # (gateway, from, to): its unflushed usage may be lost


def _usage_bounds(
    calls: list[Call], kills: list[GatewayKill]
) -> tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]:
    """(seen by the clients, what may be lost, what may be added): (requests, prompt tokens,
    completion tokens) each. Lost: what a killed gateway served in its last flush interval
    before it died (accounting.py), of any key. Added: failed requests may be billed (their
    prompt and at most their max_tokens) for what they streamed."""
    ok = [c for c in calls if c.ok]
    failed = [c for c in calls if not c.ok]
    lost = [
        c
        for c in ok
        if any(
            c.gateway == gw and t0 - USAGE_LOSS_WINDOW_S <= c.ended <= t1 for gw, t0, t1 in kills
        )
    ]
    prompt_max = max((c.prompt_tokens for c in ok), default=0)

    def total(cs: list[Call]) -> tuple[int, int, int]:
        return len(cs), sum(c.prompt_tokens for c in cs), sum(c.completion_tokens for c in cs)

    return (
        total(ok),
        total(lost),
        (len(failed), prompt_max * len(failed), sum(c.max_tokens for c in failed)),
    )


def _judge_usage(
    fleet: FaultFleet, ph: Phase, calls: list[Call], kills: list[GatewayKill], problems: list[str]
) -> dict[str, Any]:
    # A kill after this key's last call cannot lose its usage: the next phase waited until it
    # was in Postgres before killing anything.
    last = max((c.ended for c in calls), default=0.0)
    seen, may_lose, may_add = _usage_bounds(calls, [k for k in kills if k[1] <= last])
    recorded = fleet.usage(ph.name)
    for i, what in enumerate(("requests", "prompt tokens", "completion tokens")):
        if not seen[i] - may_lose[i] <= recorded[i] <= seen[i] + may_add[i]:
            problems.append(
                f"{ph.name}: usage {what}: recorded {recorded[i]}, the clients saw {seen[i]} "
                f"(may lose {may_lose[i]}, may add {may_add[i]})"
            )
    return {
        "usage_seen_by_clients": seen,
        "usage_recorded": recorded,
        "usage_lost_bound": may_lose,
    }
