"""The node agent end to end: `llmgw agent` + `llmgw shard-run` wrappers + simulator engines as
real processes, against the protocol test server (tests/nodeagent/protocol_server.py).

Each test drives the control plane's side (desired sets, outages, credentials) and asserts
on what the agent reports, on the engines' real processes (pids, /proc), and on its log.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from llmgw.nodeagent.procs import is_alive, marked_pids, proc_start_time
from llmgw.nodeagent.records import read_procs, read_record, write_model
from llmgw.protocol import DesiredShard, ShardBinding
from tests.nodeagent.agent_harness import AgentProcess, sim_shard
from tests.nodeagent.protocol_server import ProtocolServer
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

Factory = Callable[..., AgentProcess]
Ids = Callable[[str], str]


def _start_times(pids: list[int]) -> dict[int, int | None]:
    return {p: proc_start_time(p) for p in pids}


def _wait_exited(started: dict[int, int | None]) -> None:
    """Wait until none of these processes (pid and start time, so a reused pid does not count)
    is alive. One that is exiting has already dropped its environment, so its marker, while not
    yet a zombie: a marker scan that comes up empty does not mean every process has finished."""

    def alive() -> list[int]:
        return [p for p, t in started.items() if t is not None and proc_start_time(p) == t]

    wait_for(lambda: alive() == [], timeout_s=5, what=f"processes {sorted(started)} to exit")


def _registered(cp: ProtocolServer, agent: AgentProcess, name: str = "node-a") -> None:
    def ok() -> bool:
        agent.assert_alive()
        try:
            cp.node(name)
        except KeyError:
            return False
        return True

    wait_for(ok, timeout_s=20, what="the agent to register")


def _states(cp: ProtocolServer, agent: AgentProcess) -> dict[str, ShardBinding]:
    agent.assert_alive()
    return cp.bindings("node-a")


def _wait_states(
    cp: ProtocolServer, agent: AgentProcess, want: dict[str, str], *, timeout_s: float = 30
) -> dict[str, ShardBinding]:
    def ok() -> dict[str, ShardBinding] | None:
        b = _states(cp, agent)
        got = {sid: x.observed_state for sid, x in b.items()}
        return b if got == want else None

    try:
        return wait_for(ok, timeout_s=timeout_s, what=f"bindings {want}")
    except AssertionError:
        got = {s: (b.observed_state, b.reason) for s, b in cp.bindings("node-a").items()}
        raise AssertionError(
            f"wanted {want}, have {got}\n{agent.log_path.read_text()[-3000:]}"
        ) from None


def _proxied_ok(url: str, key: str = "engine-key-0123456789") -> bool:
    r = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {key}"}, timeout=2)
    return r.status_code == 200


def _health_ok(b: ShardBinding) -> bool:
    r = httpx.get(f"http://127.0.0.1:{b.http_port}/health", timeout=2)
    return r.status_code == 200


def test_desired_changes_act_only_on_the_difference(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    a, b, c = shard_ids("a"), shard_ids("b"), shard_ids("c")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(a), sim_shard(b)])
    first = _wait_states(cp, agent, {a: "ready", b: "ready"})
    b_pids = _start_times(marked_pids(b))
    assert b_pids, "the shard's processes carry its marker"
    cp.set_desired("node-a", [sim_shard(a), sim_shard(c)])
    after = _wait_states(cp, agent, {a: "ready", c: "ready"})
    # a was left alone: same engine process, no restart.
    assert (
        after[a].pid == first[a].pid and after[a].process_start_time == first[a].process_start_time
    )
    assert after[a].restarts == 0
    # b is gone, every process of it: wrapper, engine and anything they started.
    wait_for(lambda: marked_pids(b) == [], timeout_s=10, what="b's processes to be gone")
    _wait_exited(b_pids)
    assert not (agent.state_dir / "shards" / b).exists()
    # A changed spec (new fingerprint) restarts that shard, and only it.
    cp.set_desired("node-a", [sim_shard(a), sim_shard(c, fingerprint="fp-2")])

    def c_restarted() -> bool:
        x = _states(cp, agent)
        return (
            x[c].observed_state == "ready"
            and x[c].pid != after[c].pid
            and x[c].fingerprint == "fp-2"
        )

    wait_for(c_restarted, timeout_s=30, what="c restarted with its new spec")
    assert _states(cp, agent)[a].pid == first[a].pid
    events = [e["event"] for e in agent.log_events() if e.get("shard") == a]
    assert events.count("shard_started") == 1 and "shard_stopping" not in events


def test_stopping_engines_on_exit_reports_them_exited_and_brings_them_back_next_start(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    """`llmgw up`'s Ctrl-C: the agent stops its engines, then tells the control plane, so no
    gateway routes to an engine that is gone; the next start runs the same shards again."""
    a = shard_ids("a")
    agent = agent_factory(extra_args=("--stop-engines-on-exit",))
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(a)])
    before = _wait_states(cp, agent, {a: "ready"})
    assert agent.terminate() == 0
    assert marked_pids(a) == [] and before[a].pid is not None
    _wait_exited({before[a].pid: before[a].process_start_time})
    last = cp.bindings("node-a")[a]
    assert last.observed_state == "exited", last
    assert "agent exited" in last.reason
    agent = agent_factory(extra_args=("--stop-engines-on-exit",))
    after = _wait_states(cp, agent, {a: "ready"})
    assert after[a].pid != before[a].pid


def test_agent_kill9_then_restart_adopts_every_engine_without_restarting_it(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    ids = [shard_ids(f"k{i}") for i in range(3)]
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s) for s in ids])
    before = _wait_states(cp, agent, dict.fromkeys(ids, "ready"))
    wait_for(
        lambda: all(b.proxy_url for b in _states(cp, agent).values()),
        timeout_s=10,
        what="a front door URL for every ready shard",
    )
    before = _states(cp, agent)
    first_epoch = cp.node("node-a").epoch_seq[0]
    agent.kill9()
    # The engines do not depend on the agent: still serving, through their front doors too.
    assert all(_health_ok(before[s]) for s in ids)
    assert all(_proxied_ok(before[s].proxy_url) for s in ids)
    n_before = len(cp.history("node-a"))
    agent2 = agent_factory()

    def new_epoch_sync() -> list[ShardBinding] | None:
        agent2.assert_alive()
        for req in cp.history("node-a")[n_before:]:
            if req.agent_epoch > first_epoch:
                return list(req.bindings)
        return None

    # The new agent's first report already has every engine ready, same processes.
    first_report = wait_for(new_epoch_sync, timeout_s=20, what="the restarted agent's first sync")
    assert {b.shard_id: b.observed_state for b in first_report} == dict.fromkeys(ids, "ready")
    for b in first_report:
        assert (b.pid, b.process_start_time, b.proxy_url) == (
            before[b.shard_id].pid,
            before[b.shard_id].process_start_time,
            before[b.shard_id].proxy_url,
        )
    # And after the control plane's answer: adopted, not restarted.
    wait_for(lambda: len(agent2.events("shard_adopted")) == 3, timeout_s=10, what="3 adoptions")
    after = _states(cp, agent2)
    assert {s: (after[s].pid, after[s].restarts) for s in ids} == {
        s: (before[s].pid, 0) for s in ids
    }
    assert agent2.events("shard_started") == []
    # Every front door is its shard's own: the agent opened no shared proxy.
    assert agent2.events("shared_proxy_serving_adopted_shards") == []


def test_killed_engine_restarts_with_backoff_and_a_crash_loop_is_reported(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    ok, bad = shard_ids("ok"), shard_ids("bad")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(ok), sim_shard(bad, args=("--no-such-flag-for-sim", "1"))])
    before = wait_for(
        lambda: (b := _states(cp, agent)).get(ok) and b[ok].observed_state == "ready" and b,
        timeout_s=30,
        what="ok ready",
    )
    os.kill(before[ok].pid or 0, signal.SIGKILL)

    def restarted() -> ShardBinding | None:
        b = _states(cp, agent)[ok]
        return b if b.observed_state == "ready" and b.pid != before[ok].pid else None

    again = wait_for(restarted, timeout_s=30, what="the killed engine restarted")
    assert again.restarts == 1
    assert again.http_port == before[ok].http_port  # ports are kept with the shard
    exited = [e for e in agent.events("shard_exited") if e["shard"] == ok]
    assert exited and exited[0]["exit_code"] == -signal.SIGKILL

    def crash_loop() -> ShardBinding | None:
        b = _states(cp, agent).get(bad)
        return b if b is not None and b.observed_state == "failed" else None

    failed = wait_for(crash_loop, timeout_s=40, what="the crashing engine reported crash-looping")
    assert failed.exit_code == 2  # the simulator's usage error
    assert "crash loop" in failed.reason
    assert "no-such-flag-for-sim" in failed.log_tail
    # Backoff: restarts spaced out, growing.
    loops = [
        e
        for e in agent.events("shard_exited") + agent.events("shard_crash_looping")
        if e["shard"] == bad
    ]
    waits = [e["restart_in_s"] for e in sorted(loops, key=lambda e: e["timestamp"])]
    assert waits == sorted(waits) and waits[-1] > waits[0]


def test_controlplane_outage_leaves_engines_alone_and_logs_each_change_once(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    ids = [shard_ids("o1"), shard_ids("o2")]
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s) for s in ids])
    before = _wait_states(cp, agent, dict.fromkeys(ids, "ready"))
    cp.down()
    # Several backoff cycles (max 1 s in tests).
    wait_for(
        lambda: len(agent.events("controlplane_unreachable")) == 1, timeout_s=10, what="outage seen"
    )
    import time

    time.sleep(3)
    agent.assert_alive()
    for s in ids:
        assert _health_ok(before[s])
        assert marked_pids(s) and (before[s].pid or 0) in marked_pids(s)
    syncs = cp.node("node-a").syncs
    cp.up()
    wait_for(lambda: cp.node("node-a").syncs > syncs + 2, timeout_s=15, what="sync resumed")
    after = _states(cp, agent)
    assert {s: after[s].pid for s in ids} == {s: before[s].pid for s in ids}
    names = [e["event"] for e in agent.log_events() if e["event"].startswith("controlplane_")]
    assert names == ["controlplane_synced", "controlplane_unreachable", "controlplane_synced"]


def test_corrupt_record_is_reported_and_skipped_the_rest_adopted(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    good, broken = shard_ids("good"), shard_ids("broken")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(good), sim_shard(broken)])
    before = _wait_states(cp, agent, {good: "ready", broken: "ready"})
    agent.terminate()  # SIGTERM: the agent goes, the engines stay
    record = agent.state_dir / "shards" / broken / "record.json"
    record.write_bytes(record.read_bytes()[:20])  # truncated mid-write
    n_before = len(cp.history("node-a"))
    agent2 = agent_factory()

    def first_report() -> dict[str, ShardBinding] | None:
        agent2.assert_alive()
        new = cp.history("node-a")[n_before:]
        return {b.shard_id: b for b in new[0].bindings} if new else None

    report = wait_for(first_report, timeout_s=20, what="the restarted agent's first sync")
    assert report[good].observed_state == "ready" and report[good].pid == before[good].pid
    assert report[broken].observed_state == "failed"
    assert "state record unreadable" in report[broken].reason
    assert len(agent2.events("shard_record_unreadable")) == 1
    # Still desired: its old processes are killed and it is started afresh.
    after = _wait_states(cp, agent2, {good: "ready", broken: "ready"})
    assert after[broken].pid != before[broken].pid
    assert not is_alive(before[broken].pid or 0)
    assert after[good].pid == before[good].pid


def test_refused_specs_fail_only_their_own_shard(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    good, policy, invalid, secret = (
        shard_ids("good"),
        shard_ids("policy"),
        shard_ids("invalid"),
        shard_ids("secret"),
    )
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired(
        "node-a",
        [
            sim_shard(good),
            sim_shard(policy, args=("--trust-remote-code",)),
            sim_shard(invalid, extra_profile={"tp": "many"}),
            sim_shard(secret, extra_profile={"secret_env": {"HF_TOKEN": "hf_plaintext_value"}}),
        ],
    )
    b = _wait_states(
        cp, agent, {good: "ready", policy: "failed", invalid: "failed", secret: "failed"}
    )
    assert "refused on this node" in b[policy].reason
    assert "profile.tp" in b[invalid].reason
    assert "not a reference" in b[secret].reason
    assert "hf_plaintext_value" not in agent.log_path.read_text()
    assert all(marked_pids(s) == [] for s in (policy, invalid, secret))


def test_revoked_credential_is_refused_and_nothing_is_acted_on(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    ids = [shard_ids("r1"), shard_ids("r2")]
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s) for s in ids])
    before = _wait_states(cp, agent, dict.fromkeys(ids, "ready"))
    cp.revoke("node-a")
    cp.set_desired("node-a", [], confirmed_drain=True)
    wait_for(lambda: agent.events("controlplane_refused"), timeout_s=10, what="refusal")
    import time

    time.sleep(2)
    assert len(agent.events("controlplane_refused")) == 1
    assert agent.events("shard_stopping") == []
    assert all((before[s].pid or 0) in marked_pids(s) for s in ids)
    assert "Bearer" not in agent.log_path.read_text()


def test_foreign_cluster_id_is_not_obeyed(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    s = shard_ids("f")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s)])
    before = _wait_states(cp, agent, {s: "ready"})
    cp.cluster_id = "cluster-restored-from-backup"
    cp.set_desired("node-a", [], confirmed_drain=True)
    wait_for(lambda: agent.events("cluster_id_mismatch"), timeout_s=10, what="mismatch logged")
    import time

    time.sleep(1.5)
    assert len(agent.events("cluster_id_mismatch")) == 1
    assert (before[s].pid or 0) in marked_pids(s)


def test_more_than_half_is_stopped_only_with_a_confirmed_drain(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    ids = [shard_ids(f"h{i}") for i in range(3)]
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s) for s in ids])
    _wait_states(cp, agent, dict.fromkeys(ids, "ready"))
    cp.set_desired("node-a", [])
    wait_for(
        lambda: all(
            b.observed_state == "ready" and "stop held" in b.reason
            for b in _states(cp, agent).values()
        ),
        timeout_s=10,
        what="stops held and reported",
    )
    assert len(agent.events("shard_stops_held")) == 1
    assert all(marked_pids(s) for s in ids)
    cp.set_desired("node-a", [], confirmed_drain=True)
    wait_for(lambda: _states(cp, agent) == {}, timeout_s=20, what="all stopped")
    assert all(marked_pids(s) == [] for s in ids)


def test_state_dir_and_identity_are_private(
    cp: ProtocolServer, agent_factory: Factory, tmp_path: Path
) -> None:
    agent = agent_factory()
    _registered(cp, agent)
    wait_for(lambda: (agent.state_dir / "identity.json").exists(), timeout_s=10, what="identity")
    assert (agent.state_dir.stat().st_mode & 0o777) == 0o700
    assert ((agent.state_dir / "identity.json").stat().st_mode & 0o777) == 0o600
    text = agent.log_path.read_text()
    assert "boot-token-0123456789" not in text
    assert cp.node("node-a").credential not in text


def test_healthz_and_metrics(cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids) -> None:
    s = shard_ids("m")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s)])
    _wait_states(cp, agent, {s: "ready"})
    health = agent.health()
    assert health["sync_state"] == "synced" and health["shards"] == {"ready": 1}
    text = httpx.get(f"http://127.0.0.1:{agent.listen_port}/metrics", timeout=2).text
    assert 'llmgw_agent_shards{state="ready"} 1.0' in text
    assert 'llmgw_agent_shard_actions_total{action="starts"} 1.0' in text
    assert "llmgw_agent_sync_latency_seconds_count" in text
    assert "llmgw_agent_sync_failures_total 0.0" in text


def test_ready_leaders_are_exposed_through_the_authenticating_proxy(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    s = shard_ids("p")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s, key="proxy-key-0123456789")])
    url = wait_for(
        lambda: (b := _states(cp, agent).get(s)) and b.observed_state == "ready" and b.proxy_url,
        timeout_s=30,
        what="a proxy URL for the ready shard",
    )
    assert url.startswith("http://127.0.0.1:") and url.endswith(f"/shards/{s}")
    # The shard's front door, on a port of the agent's proxy range (agent_harness.py).
    port = int(url.split(":")[2].split("/")[0])
    env = agent.env
    assert int(env["LLMGW_AGENT__PROXY_PORT_RANGE_START"]) <= port
    assert port <= int(env["LLMGW_AGENT__PROXY_PORT_RANGE_END"])
    assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
    ok = httpx.get(
        f"{url}/v1/models", headers={"Authorization": "Bearer proxy-key-0123456789"}, timeout=5
    )
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "demo"
    # Only the routes the gateway needs: the engine's control routes are not reachable.
    assert (
        httpx.post(
            f"{url}/suspend", headers={"Authorization": "Bearer proxy-key-0123456789"}
        ).status_code
        == 404
    )


def test_a_pending_node_waits_saying_so_once_then_runs_when_approved(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    s = shard_ids("pend")
    cp.require_approval = True
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s)])
    wait_for(lambda: cp.node("node-a").syncs >= 5, timeout_s=10, what="several syncs")
    assert len(agent.events("node_pending_approval")) == 1
    assert marked_pids(s) == []
    cp.approve("node-a")
    _wait_states(cp, agent, {s: "ready"})
    # The registration carried the inventory; unchanged since, no sync repeats it.
    assert cp.node("node-a").inventories_received == 0
    agent.terminate()
    agent2 = agent_factory()
    wait_for(lambda: cp.node("node-a").inventories_received == 1, timeout_s=10, what="inventory")
    # The restarted agent reuses its credential: one registration in all.
    wait_for(lambda: agent2.events("shard_adopted"), timeout_s=10, what="adoption")
    assert agent2.events("node_registered") == [] and len(agent.events("node_registered")) == 1


_FAKE_LLAMA_SERVER = """\
import http.server, os, sys
# A llama.cpp build as the node has it: it sees a GPU only behind CUDA_VISIBLE_DEVICES=1
# (the other card stands for a build without the CUDA backend, which serves from the CPU).
if "--list-devices" in sys.argv:
    print("Available devices:")
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "1":
        print("  CUDA0: NVIDIA H100 80GB HBM3 (81559 MiB, 80000 MiB free)")
    sys.exit(0)
port = int(sys.argv[sys.argv.index("--port") + 1])
if "--spawn-stubborn" in sys.argv:
    # An engine that ignores SIGTERM, with a child that does too and a grandchild that left
    # the process group: only SIGKILL to the group and the marker scan get them all.
    import signal, subprocess
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    subprocess.Popen([sys.executable, "-c", code])
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_an_engine_that_fell_back_to_the_cpu_is_never_ready(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids, tmp_path: Path
) -> None:
    import json
    import sys

    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n{_FAKE_LLAMA_SERVER}")
    fake.chmod(0o755)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "gpus:\n  - {index: 0, uuid: GPU-a, name: H100}\n  - {index: 1, uuid: GPU-b, name: H100}\n"
    )
    cpu, gpu = shard_ids("cpu"), shard_ids("gpu")
    agent = agent_factory(
        extra_env={
            "LLMGW_AGENT__INVENTORY_FILE": str(inv),
            "LLMGW_AGENT__ENGINES": json.dumps({"llamacpp": {"path": str(fake)}}),
        }
    )
    _registered(cp, agent)

    def shard(sid: str, gpu_index: int) -> DesiredShard:
        d = sim_shard(sid, extra_profile={"engine": "llamacpp", "gpu_class": "H100", "args": []})
        spec = {**d.spec, "gpu_indices": [gpu_index]}
        spec["profile"] = {**spec["profile"], "model_path": "/models/m.gguf"}
        return d.model_copy(update={"spec": spec})

    cp.set_desired("node-a", [shard(cpu, 0), shard(gpu, 1)])
    b = _wait_states(cp, agent, {cpu: "unhealthy", gpu: "ready"})
    assert "sees no GPU" in b[cpu].reason and b[cpu].proxy_url == ""


def test_stopping_a_shard_kills_children_that_ignore_sigterm_or_left_the_group(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids, tmp_path: Path
) -> None:
    import json
    import sys
    import time

    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n{_FAKE_LLAMA_SERVER}")
    fake.chmod(0o755)
    inv = tmp_path / "inventory.yaml"
    inv.write_text("gpus:\n  - {index: 1, uuid: GPU-b, name: H100}\n")
    s = shard_ids("stub")
    agent = agent_factory(
        extra_env={
            "LLMGW_AGENT__INVENTORY_FILE": str(inv),
            "LLMGW_AGENT__ENGINES": json.dumps({"llamacpp": {"path": str(fake)}}),
        }
    )
    _registered(cp, agent)
    d = sim_shard(
        s, extra_profile={"engine": "llamacpp", "gpu_class": "H100", "args": ["--spawn-stubborn"]}
    )
    spec = {**d.spec, "gpu_indices": [1]}
    spec["profile"] = {**spec["profile"], "model_path": "/models/m.gguf"}
    cp.set_desired("node-a", [d.model_copy(update={"spec": spec})])
    _wait_states(cp, agent, {s: "ready"})
    pids = wait_for(lambda: len(p := marked_pids(s)) >= 4 and p, timeout_s=10, what="4 processes")
    groups = {os.getpgid(p) for p in pids}
    assert len(groups) >= 3  # wrapper's session group, the engine's group, the escapee's
    started = _start_times(pids)
    t0 = time.monotonic()
    cp.set_desired("node-a", [])
    wait_for(lambda: marked_pids(s) == [], timeout_s=20, what="every process of the shard gone")
    assert time.monotonic() - t0 >= 2.0  # SIGTERM was ignored: SIGKILL after the grace period
    _wait_exited(started)
    wait_for(lambda: _states(cp, agent) == {}, timeout_s=10, what="the shard forgotten")


def test_suspend_and_resume_keep_the_process(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    s = shard_ids("sus")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s)])
    before = _wait_states(cp, agent, {s: "ready"})

    def engine_state() -> str:
        r = httpx.get(f"http://127.0.0.1:{before[s].http_port}/health", timeout=2)
        return str(r.json()["state"])

    cp.set_desired("node-a", [sim_shard(s, desired_state="suspended")])
    wait_for(lambda: engine_state() == "suspended", timeout_s=10, what="suspended")
    wait_for(lambda: "suspended" in _states(cp, agent)[s].reason, timeout_s=10, what="reported")
    cp.set_desired("node-a", [sim_shard(s)])
    wait_for(lambda: engine_state() == "running", timeout_s=10, what="resumed")
    assert _states(cp, agent)[s].pid == before[s].pid


def test_an_unreadable_record_of_a_shard_no_longer_desired_is_cleaned_up(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    good, broken = shard_ids("good"), shard_ids("gone")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(good), sim_shard(broken)])
    before = _wait_states(cp, agent, {good: "ready", broken: "ready"})
    agent.terminate()
    (agent.state_dir / "shards" / broken / "record.json").write_text("{not json")
    cp.set_desired("node-a", [sim_shard(good)])
    agent2 = agent_factory()
    # Its processes cannot be proven ours, so none is adopted; not desired, they are killed.
    wait_for(lambda: marked_pids(broken) == [], timeout_s=20, what="the unmanaged processes gone")
    after = _wait_states(cp, agent2, {good: "ready"})
    assert after[good].pid == before[good].pid


def test_adapters_from_http_are_fetched_once_and_a_failing_source_fails_its_shard(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids, tmp_path: Path
) -> None:
    import hashlib
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    payload = b"adapter-bytes" * 10

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/sql.safetensors":
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *a: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}/"
    try:
        ok, bad = shard_ids("lora"), shard_ids("lorabad")
        agent = agent_factory(
            extra_env={
                "LLMGW_AGENT__POLICY__ALLOWED_ADAPTER_SOURCES": json.dumps([base]),
                "LLMGW_AGENT__POLICY__ADAPTER_FETCH_ALLOW_LOOPBACK": "true",
            }
        )
        _registered(cp, agent)
        src = f"{base}sql.safetensors#sha256={hashlib.sha256(payload).hexdigest()}"
        cp.set_desired(
            "node-a",
            [
                sim_shard(ok, extra_profile={"adapters": [{"name": "sql", "path": src}]}),
                sim_shard(
                    bad, extra_profile={"adapters": [{"name": "x", "path": f"{base}missing"}]}
                ),
            ],
        )
        b = _wait_states(cp, agent, {ok: "ready", bad: "failed"})
        assert "answered 404" in b[bad].reason
        local = agent.state_dir / "adapters" / hashlib.sha256(src.encode()).hexdigest()
        assert local.read_bytes() == payload
        models = httpx.get(
            f"http://127.0.0.1:{b[ok].http_port}/v1/models",
            headers={"Authorization": "Bearer engine-key-0123456789"},
        ).json()
        assert [m["id"] for m in models["data"]] == ["demo", "sql"]
        import time

        time.sleep(1.0)
        assert len([e for e in agent.events("shard_start_failed") if e["shard"] == bad]) == 1
    finally:
        httpd.shutdown()


def test_a_kv_events_shard_gets_its_ports_kept_across_restarts(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    s = shard_ids("kv")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s, kv_events=True)])
    b = _wait_states(cp, agent, {s: "ready"})[s]
    ports = (b.http_port, b.kv_events_port, b.kv_replay_port)
    assert all(ports) and len(set(ports)) == 3
    assert agent.events("shard_hook_failed") == []
    os.kill(b.pid or 0, signal.SIGKILL)
    again = wait_for(
        lambda: (x := _states(cp, agent)[s]).observed_state == "ready" and x.pid != b.pid and x,
        timeout_s=30,
        what="restart",
    )
    # The engine's PUB must find the relay's SUB where it was: ports stay with the shard.
    assert (again.http_port, again.kv_events_port, again.kv_replay_port) == ports


def test_a_killed_wrapper_takes_its_engine_with_it_and_the_shard_restarts(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    import json

    s = shard_ids("wrap")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s)])
    b = _wait_states(cp, agent, {s: "ready"})[s]
    record = json.loads((agent.state_dir / "shards" / s / "record.json").read_text())
    os.kill(record["wrapper_pid"], signal.SIGKILL)
    # Nothing would stop the orphaned engine, which holds the shard's port: killed by marker.
    wait_for(lambda: not is_alive(b.pid or 0), timeout_s=10, what="the orphaned engine killed")
    again = wait_for(
        lambda: (x := _states(cp, agent)[s]).observed_state == "ready" and x.pid != b.pid and x,
        timeout_s=30,
        what="restart",
    )
    assert again.http_port == b.http_port and again.restarts == 1


def test_a_shard_adopted_from_a_wrapper_without_a_front_door_is_served_by_the_agent(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids
) -> None:
    """Version skew: an agent of an earlier release served every engine's proxy itself, and its
    wrappers serve none. The agent that adopts such a shard opens its shared proxy for it."""
    s = shard_ids("old")
    agent = agent_factory()
    _registered(cp, agent)
    cp.set_desired("node-a", [sim_shard(s)])
    wait_for(
        lambda: (b := _states(cp, agent).get(s)) and b.proxy_url,
        timeout_s=30,
        what="the shard ready behind its front door",
    )
    pid = _states(cp, agent)[s].pid
    agent.kill9()
    # What the earlier release left on disk: no front door port in the record, none in the
    # wrapper's procs.json.
    d = agent.state_dir / "shards" / s
    rec = read_record(d)
    write_model(d / "record.json", rec.model_copy(update={"proxy_port": 0}))
    procs = read_procs(d)
    assert procs is not None and procs.proxy_port
    write_model(d / "procs.json", procs.model_copy(update={"proxy_port": None, "proxy_host": ""}))
    agent2 = agent_factory()
    shared = wait_for(
        lambda: agent2.events("shared_proxy_serving_adopted_shards"),
        timeout_s=20,
        what="the shared proxy opened",
    )[0]
    assert shared["shards"] == [s]
    url = wait_for(
        lambda: (
            (b := _states(cp, agent2).get(s))
            and b.proxy_url
            and f":{shared['port']}/" in b.proxy_url
            and _proxied_ok(b.proxy_url)
            and b.proxy_url
        ),
        timeout_s=20,
        what="the adopted shard served through the agent's shared proxy",
    )
    assert url.endswith(f"/shards/{s}") and _states(cp, agent2)[s].pid == pid
