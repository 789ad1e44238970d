"""The node agent's supervision acceptance against the REAL control plane: `llmgw controlplane`
(reconciler on) on a throwaway Postgres, deployments applied through the admin API, a real
`llmgw agent` on an inventory file of four H100s, and a small llama-server stand-in as the
engine (it can spawn children that ignore SIGTERM, or crash at start with a message).

One fleet, in order:

- a crash at start is reported crash-looping with its exit code and log tail; a spec the
  node's local policy refuses fails that shard only; the other shards run untouched;
- a deployment scaled down: only the difference is acted on, and the stopped shard's whole
  process tree is gone, children that ignored SIGTERM and one that left the group included;
- the control plane down for several backoff cycles: engines untouched, sync resumes by
  itself, one log line per state change;
- a truncated state record: that shard reported and restarted, the rest adopted;
- a wrong node credential: refused, nothing acted on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.nodeagent.procs import is_alive, kill_marked, marked_pids
from tests.nodeagent.agent_harness import AgentProcess
from tests.nodeagent.realcp import RealControlPlane
from tests.support.procs import agent_port_base, free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

_FAKE_LLAMA_SERVER = """
import http.server, os, signal, subprocess, sys
if "--list-devices" in sys.argv:
    print("Available devices:")
    print("  CUDA0: NVIDIA H100 80GB HBM3 (81559 MiB, 80000 MiB free)")
    sys.exit(0)
if "--crash" in sys.argv:
    print("fatal: cannot load /models/m.gguf: bad magic", file=sys.stderr, flush=True)
    sys.exit(3)
port = int(sys.argv[sys.argv.index("--port") + 1])
if "--spawn-stubborn" in sys.argv:
    # Ignores SIGTERM, with a child that does too and a grandchild that left the process
    # group: only SIGKILL to the group and the marker scan get them all.
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


def _docs(name: str, replicas: int, *args: str) -> list[dict[str, Any]]:
    return [
        {"kind": "model", "name": name},
        {"kind": "profile", "name": f"{name}-p", "model": name, "engine": "llamacpp",
         "gpu_class": "H100", "model_path": "/models/m.gguf", "args": list(args)},
        {"kind": "deployment", "name": name, "model": name, "profile": f"{name}-p",
         "replicas": replicas},
    ]  # fmt: skip


def _rows(cp: RealControlPlane, deployment: str) -> list[dict[str, Any]]:
    """Every shard of the deployment, stopped ones included."""
    rows = cp.sql(
        "SELECT s.id, s.desired_state, s.observed_state, s.observed_reason, s.pid, s.restarts, "
        "s.exit_code, s.log_tail, s.released FROM shards s JOIN replicas r ON r.id = s.replica_id "
        "JOIN deployments d ON d.id = r.deployment_id WHERE d.name = %s ORDER BY s.id",
        (deployment,),
    )
    keys = ("id", "desired", "state", "reason", "pid", "restarts", "exit_code", "log_tail",
            "released")  # fmt: skip
    return [dict(zip(keys, (str(r[0]), *r[1:]), strict=True)) for r in rows]


def _metric(agent: AgentProcess, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{agent.listen_port}/metrics", timeout=2).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_supervision_outage_and_bad_input_against_the_real_control_plane(
    realcp: RealControlPlane, tmp_path: Path
) -> None:
    cp = realcp
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n{_FAKE_LLAMA_SERVER}")
    fake.chmod(0o755)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        "gpus:\n" + "".join(f"  - {{index: {i}, uuid: GPU-{i}, name: H100}}\n" for i in range(4))
    )
    listen, base = free_port(), agent_port_base()
    state = tmp_path / "state"

    def agent_process(n: int, token: str) -> AgentProcess:
        return AgentProcess(
            state_dir=state,
            controlplane_url=cp.url,
            listen_port=listen,
            log_path=tmp_path / f"agent-{n}.log",
            port_range=(base, base + 63),
            token=token,
            node_name="fleet-node",
            extra_env={
                "LLMGW_AGENT__INVENTORY_FILE": str(inventory),
                "LLMGW_AGENT__ENGINES": json.dumps({"llamacpp": {"path": str(fake)}}),
                "LLMGW_AGENT__POLICY__REFUSED_FLAGS": '["--trust-remote-code", "--forbidden"]',
            },
        )

    agent = agent_process(0, cp.bootstrap_token()).start()
    agents = [agent]
    try:
        cp.apply(
            _docs("keep", 2, "--spawn-stubborn") + _docs("crash", 1, "--crash")
            + _docs("refused", 1, "--forbidden")
        )  # fmt: skip

        def keep_ready() -> list[dict[str, Any]] | None:
            agent.assert_alive()
            rows = [r for r in _rows(cp, "keep") if r["desired"] == "running"]
            return rows if len(rows) == 2 and all(r["state"] == "ready" for r in rows) else None

        keep = wait_for(keep_ready, timeout_s=40, what="both keep shards ready")

        # A crash at start: crash-looping, with its exit code and the end of its log.
        def crash_looping() -> dict[str, Any] | None:
            agent.assert_alive()
            failed = [r for r in _rows(cp, "crash") if r["state"] == "failed"]
            return failed[0] if failed else None

        crashed = wait_for(crash_looping, timeout_s=40, what="the crashing shard reported")
        assert crashed["exit_code"] == 3 and "crash loop" in crashed["reason"]
        assert "bad magic" in crashed["log_tail"]
        # A spec the node's policy refuses fails that shard alone.
        refused = wait_for(
            lambda: [r for r in _rows(cp, "refused") if r["state"] == "failed"],
            timeout_s=20,
            what="the refused shard reported",
        )
        assert "--forbidden" in refused[0]["reason"]
        assert not marked_pids(refused[0]["id"])
        assert keep_ready() == keep, "the other shards were disturbed"
        # Done with them: the reconciler stops them (so the fleet is quiet from here on).
        for dep in ("crash", "refused"):
            assert cp.admin.delete(f"/deployments/{dep}").status_code == 204

        # Scale keep down to 1: only the difference is acted on.
        trees = {r["id"]: wait_for(lambda r=r: len(p := marked_pids(r["id"])) >= 4 and p,
                                   timeout_s=10, what="4 processes per keep shard")
                 for r in keep}  # fmt: skip
        cp.apply(_docs("keep", 1, "--spawn-stubborn"))

        def scaled() -> tuple[dict[str, Any], dict[str, Any]] | None:
            rows = {r["id"]: r for r in _rows(cp, "keep")}
            # Released, or already deleted with its replica (the reconciler deletes a replica
            # whose every shard exited, possibly before a poll sees it released).
            gone = [k for k in keep if k["id"] not in rows or rows[k["id"]]["released"]]
            kept = [rows[k["id"]] for k in keep
                    if k["id"] in rows and rows[k["id"]]["desired"] == "running"]  # fmt: skip
            return (gone[0], kept[0]) if gone and kept else None

        gone, kept = wait_for(scaled, timeout_s=40, what="one keep shard stopped and released")
        wait_for(
            lambda: all(r["released"] for d in ("crash", "refused") for r in _rows(cp, d)),
            timeout_s=30,
            what="the deleted deployments' shards released",
        )
        assert marked_pids(gone["id"]) == []
        assert not any(is_alive(p) for p in trees[gone["id"]])
        assert kept["pid"] == next(k["pid"] for k in keep if k["id"] == kept["id"])
        assert kept["restarts"] == 0
        started = [e for e in agent.events("shard_started") if e.get("shard") == kept["id"]]
        assert len(started) == 1

        # The control plane down for several backoff cycles.
        acted = len(agent.events("shard_stopping")) + len(agent.events("shard_started"))
        cp.kill()
        failures = _metric(agent, "llmgw_agent_sync_failures")
        wait_for(
            lambda: _metric(agent, "llmgw_agent_sync_failures") >= failures + 4,
            timeout_s=20,
            what="several failed syncs",
        )
        agent.assert_alive()
        assert kept["pid"] in marked_pids(kept["id"])
        assert len(agent.events("shard_stopping")) + len(agent.events("shard_started")) == acted
        synced = len(agent.events("controlplane_synced"))
        cp.start()
        wait_for(
            lambda: len(agent.events("controlplane_synced")) > synced,
            timeout_s=20,
            what="sync resumed by itself",
        )
        changes = [e["event"] for e in agent.log_events() if e["event"].startswith("controlplane_")]
        assert changes[-2:] == ["controlplane_unreachable", "controlplane_synced"]
        assert changes.count("controlplane_unreachable") == 1

        # A truncated state record: that shard reported and restarted, the agent runs on.
        agent.terminate()
        record = state / "shards" / kept["id"] / "record.json"
        record.write_bytes(record.read_bytes()[:20])
        agent = agent_process(1, "")
        agents.append(agent)
        agent.start()
        wait_for(
            lambda: agent.assert_alive() or agent.events("shard_record_unreadable"),
            timeout_s=20,
            what="the unreadable record reported",
        )

        # The control plane answers a failed report by replacing the replica (reconciler):
        # either way the deployment is served again, and no process of the old one is left.
        def serving_again() -> dict[str, Any] | None:
            agent.assert_alive()
            rows = [r for r in _rows(cp, "keep") if r["desired"] == "running"]
            ready = [r for r in rows if r["state"] == "ready" and r["pid"] != kept["pid"]]
            return ready[0] if len(rows) == 1 and ready else None

        old_pid = kept["pid"]
        kept = wait_for(serving_again, timeout_s=40, what="keep served again")
        assert not is_alive(old_pid)
        assert len(agent.events("shard_record_unreadable")) == 1

        # A wrong node credential: refused, nothing acted on.
        agent.terminate()
        identity = state / "identity.json"
        ident = json.loads(identity.read_text())
        real_credential = ident["node_credential"]
        ident["node_credential"] = "llmgwn_" + "x" * 40
        identity.write_text(json.dumps(ident))
        before_pids = marked_pids(kept["id"])
        agent = agent_process(2, "")
        agents.append(agent)
        agent.start()
        wait_for(
            lambda: agent.assert_alive() or agent.events("controlplane_refused"),
            timeout_s=20,
            what="the credential refused",
        )
        refusals = _metric(agent, "llmgw_agent_sync_failures")
        wait_for(
            lambda: _metric(agent, "llmgw_agent_sync_failures") >= refusals + 2,
            timeout_s=20,
            what="more refused syncs",
        )
        assert len(agent.events("controlplane_refused")) == 1
        for name in ("shard_started", "shard_stopping", "shard_replacing"):
            assert agent.events(name) == [], name
        assert marked_pids(kept["id"]) == before_pids
        # Neither credential is ever logged, by any of the agent's runs.
        logs = "".join(a.log_path.read_text() for a in agents)
        assert real_credential not in logs and ident["node_credential"] not in logs
    finally:
        for a in agents:
            a.terminate()
        for dep in ("keep", "crash", "refused"):
            for r in _rows(cp, dep):
                kill_marked(r["id"])
