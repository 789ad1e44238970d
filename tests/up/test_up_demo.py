"""`llmgw up` with the demo, end to end, as real processes: Postgres, control plane, agent,
simulator engines. What a newcomer does is what runs here: start it, paste the printed
examples, look at `llmgw status`, press Ctrl-C, start it again, and survive `kill -9`.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from tests.support.waiting import wait_for
from tests.up.up_harness import Up, our_pids, shard_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _examples(stdout: str) -> str:
    """The copy-paste block of the announcement, exactly as printed."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Try it"))
    end = next(i for i, line in enumerate(lines) if line.startswith("Press Ctrl-C"))
    return "\n".join(lines[start + 1 : end]) + "\n"


def _no_processes_left(up: Up, shards: set[str]) -> None:
    left = wait_for(
        lambda: not our_pids(up, shards) or None,
        timeout_s=15,
        what="every process of `llmgw up` to be gone",
    )
    assert left


def _demo_tokenizes_locally(info: dict[str, Any]) -> bool:
    r = httpx.post(
        f"{info['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {info['api_key']}"},
        json={"model": "demo", "max_tokens": 2,
              "messages": [{"role": "user", "content": "Say hello to the tiny model."}]},
        timeout=10,
    )  # fmt: skip
    assert r.status_code == 200, r.text[:500]
    text = httpx.get(f"{info['admin_url']}/metrics", timeout=10).text
    return any(
        sample.labels == {"model": "demo", "mode": "local"} and sample.value == 1
        for family in text_string_to_metric_families(text)
        if family.name == "llmgw_prefix_tokenizer_mode"
        for sample in family.samples
    )


def test_up_demo_examples_status_ctrl_c_and_second_run(pg_tmp_path: Path) -> None:
    up = Up.new(pg_tmp_path).start()
    shards: set[str] = set()
    try:
        info = up.wait_up()
        assert stat.S_IMODE((up.data_dir / "up.json").stat().st_mode) == 0o600
        for name in ("api_key.json", "agent.bootstrap-token", "admin_token"):
            assert stat.S_IMODE((up.data_dir / name).stat().st_mode) == 0o600, name
        assert info["base_url"] == f"http://127.0.0.1:{up.port}/v1"
        assert info["admin_url"] == f"http://127.0.0.1:{up.admin_port}"
        assert info["api_key"].startswith("llmgw_")
        assert make_url(info["database_url"]).password is None
        assert info["models"] == ["demo", "demo-sql"]

        # The printed examples, run as printed: curl plain and streaming (the LoRA name),
        # then the openai client, plain and streaming. In a shell whose PATH lacks the
        # virtual environment, as a newcomer's does: `python3` there is the system's, without
        # the openai client, and `llmgw` is not found.
        printed = up.out.read_text()
        assert info["api_key"] in printed and info["admin_token"] in printed
        venv_bin = str(Path(sys.executable).parent)
        newcomer_path = ":".join(
            d for d in os.environ["PATH"].split(":") if d and Path(d) != Path(venv_bin)
        )
        ran = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", _examples(printed)],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PATH=newcomer_path),
            check=False,
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert '"object": "chat.completion"' in ran.stdout, ran.stdout[:2000]
        assert '"model":"demo-sql"' in ran.stdout and "data: [DONE]" in ran.stdout
        python_lines = ran.stdout.rstrip().splitlines()[-2:]  # its two answers
        assert all(line.strip() for line in python_lines), ran.stdout[-2000:]
        # The status line runs as printed too, with the same PATH.
        status_line = next(ln for ln in printed.splitlines() if ln.lstrip().startswith("Status:"))
        shown = subprocess.run(
            ["bash", "-c", status_line.split("Status:", 1)[1].strip()],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PATH=newcomer_path),
            check=False,
        )
        assert shown.returncode == 0 and "SHARDS" in shown.stdout, shown.stdout + shown.stderr

        # The agent's own metrics: `up` chose its port, and says where it is.
        agent_metrics = info["agent_metrics_url"]
        assert f"Agent metrics:    {agent_metrics}" in printed
        families = {
            f.name
            for f in text_string_to_metric_families(httpx.get(agent_metrics, timeout=10).text)
        }
        assert "llmgw_agent_shards" in families, sorted(families)

        # Progress was shown while the replicas came up.
        progress = up.err.read_text()
        assert "Waiting for the demo's replicas" in progress and ": ready" in progress, progress

        # `up` announces once one chat completion went through; the second replica and the
        # reconciler's status follow within moments.
        status = wait_for(
            lambda: (
                st
                if (st := up.status_json())["deployments"]
                and st["deployments"][0]["ready"] == 2
                and [s["state"] for s in st["shards"]] == ["ready", "ready"]
                else None
            ),
            timeout_s=30,
            what="both demo replicas ready in `llmgw status`",
        )
        (dep,) = status["deployments"]
        assert (dep["name"], dep["desired"], dep["ready"], dep["updated"]) == ("demo", 2, 2, 2)
        assert dep["rollout"] == "complete"
        assert [s["state"] for s in status["shards"]] == ["ready", "ready"]
        assert len(status["nodes"]) == 1 and status["nodes"][0]["gpus"] == 2
        assert status["prefix_routing"] is None or "demo" in status["prefix_routing"]
        # Every metric the control plane exposes is in docs/metrics.md.
        documented = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
        for family in text_string_to_metric_families(
            httpx.get(f"{info['admin_url']}/metrics", timeout=10).text
        ):
            # prometheus_client's text format adds a `<counter>_created` family per counter.
            if family.name.startswith("llmgw_") and not family.name.endswith("_created"):
                suffix = "_total" if family.type == "counter" else ""
                assert f"`{family.name}{suffix}`" in documented, family.name
        # The demo routes with local tokens: the agent shipped the simulator's tiny-model
        # tokenizer files, the gateway loaded them and its checks against a replica's
        # /tokenize agreed. A chat per poll so the verification has requests to sample.
        wait_for(
            lambda: _demo_tokenizes_locally(info),
            timeout_s=20,
            interval_s=0.5,
            what='llmgw_prefix_tokenizer_mode{model="demo",mode="local"} 1',
        )
        shards = shard_ids(info)
        assert len(shards) == 2
        assert our_pids(up, shards)  # engines run (their marker is what finds them)
    finally:
        status_code = up.stop()
    assert status_code == 0, up.logs()
    assert not (up.data_dir / "up.json").exists()
    _no_processes_left(up, shards)
    # The agent stopped its engines itself (--stop-engines-on-exit), before it exited; `up`'s
    # backstop, which kills whatever a dead agent left, had nothing to do.
    assert '"engines_stopped_on_exit"' in (up.data_dir / "logs" / "agent.log").read_text()
    assert '"engine_killed_after_agent"' not in up.err.read_text()

    # A second run: same data, same key and token, the demo not applied again.
    up.start()
    try:
        again = up.wait_up()
        assert again["api_key"] == info["api_key"]
        assert again["admin_token"] == info["admin_token"]
        assert again["agent_metrics_url"] == info["agent_metrics_url"]  # its port is kept
        assert "Applying the demo" not in up.err.read_text()
        shards |= shard_ids(again)

        # The engines the first run's Ctrl-C stopped come back as started, not restarted:
        # a stop that was asked for is no crash, and reads as what it was.
        def both_ready() -> dict[str, Any] | None:
            st = up.status_json()
            return st if [s["state"] for s in st["shards"]] == ["ready", "ready"] else None

        again_status = wait_for(
            both_ready,
            timeout_s=30,
            what="both demo shards ready again in `llmgw status`",
        )
        assert [s["restarts"] for s in again_status["shards"]] == [0, 0], again_status["shards"]
        progress = up.err.read_text()
        assert "stopped by a signal" not in progress, progress
        agent_log = (up.data_dir / "logs" / "agent.log").read_text()
        assert agent_log.count('"shard_found_stopped"') == 2, agent_log[-3000:]
    finally:
        assert up.stop() == 0, up.logs()
    _no_processes_left(up, shards)


def _children(up: Up) -> dict[str, int]:
    records = json.loads((up.data_dir / "children.json").read_text())
    return {r["name"]: r["pid"] for r in records}


def test_a_killed_agent_is_restarted_alone_and_kill_9_of_up_leaves_no_engine_behind(
    pg_tmp_path: Path,
) -> None:
    up = Up.new(pg_tmp_path).start()
    try:
        info = up.wait_up()
        shards = shard_ids(info)
        before = our_pids(up, shards)
        engines = {pid for pid, cmd in before.items() if "simengine" in cmd}
        assert len(engines) == 2, before

        # kill -9 of the agent alone: `up` restarts it (and only it), the new agent adopts
        # the engines, which never stopped, and the endpoint keeps answering.
        old = _children(up)
        os.kill(old["agent"], signal.SIGKILL)
        new = wait_for(
            lambda: (c := _children(up))["agent"] != old["agent"] and c,
            timeout_s=30,
            what="`up` to restart the agent",
        )
        assert new["controlplane"] == old["controlplane"]
        agent_log = up.data_dir / "logs" / "agent.log"
        wait_for(
            lambda: (
                agent_log.read_text().count('"agent_started"') >= 2
                and all(s["state"] == "ready" for s in up.status_json()["shards"])
            ),
            timeout_s=30,
            what="the restarted agent to report its engines ready",
        )
        assert {p for p, c in our_pids(up, shards).items() if "simengine" in c} == engines
        assert agent_log.read_text().count('"shard_adopted"') >= 2
        r = httpx.post(
            f"{info['base_url']}/chat/completions",
            headers={"Authorization": f"Bearer {info['api_key']}"},
            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    finally:
        up.kill()  # SIGKILL of `up` itself: no chance to clean up

    up.start()
    try:
        again = up.wait_up()
        shards |= shard_ids(again)
        live = {s["id"] for s in up.status_json()["shards"] if s["state"] in ("ready", "starting")}
        # Every engine process alive now belongs to a shard the new run's agent reports:
        # adopted, or stopped; none left running on its own.
        for pid, cmd in our_pids(up, shards).items():
            if "simengine" in cmd:
                marker = next(
                    (s for s in shards if f"LLMGW_SHARD_ID={s}".encode() in _environ(pid)), None
                )
                assert marker in live, f"engine {pid} of shard {marker} is not accounted for"
    finally:
        assert up.stop() == 0, up.logs()
    _no_processes_left(up, shards)


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""
