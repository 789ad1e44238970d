"""llama.cpp through the whole product: `llmgw apply` → the reconciler → an agent → the
supervisor under `llmgw shard-run` → real llama-server processes → the gateway → the official
`openai` client. Then the faults: `kill -9` of an engine (restarted) and of the agent (the
engines are adopted: same pids).

llama.cpp publishes no KV events, so the gateway routes its requests by the approximate tier
and load; its load comes from llama-server's own metric names.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.fleet_harness import ReadyShard, pid_alive
from tests.gateway.gateway_fleet import GatewayFleet, metric_value
from tests.nodeagent.agent_harness import AgentProcess
from tests.support.procs import agent_port_base, free_port, llmgw_cmd
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.real_engine, pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "tiny"
NODE = "cpu-node"


def _deployment_yaml(gguf: Path) -> str:
    return f"""\
kind: model
name: {MODEL}
---
kind: profile
name: tiny-cpu
model: {MODEL}
engine: llama.cpp
gpu_class: cpu
model_path: {gguf}
threads: 1
---
kind: deployment
name: {MODEL}
model: {MODEL}
profile: tiny-cpu
replicas: 2
"""


@pytest.fixture
def fleet(db_url: str, tmp_path: Path, llama_server: str) -> Iterator[GatewayFleet]:
    f = GatewayFleet(db_url=db_url, tmp=tmp_path)
    try:
        yield f
    finally:
        f.close()


def _start_agent(f: GatewayFleet, llama_server: str) -> AgentProcess:
    base = agent_port_base()
    agent = AgentProcess(
        state_dir=f.tmp / f"{NODE}-state",
        controlplane_url=f.cp.url,
        listen_port=free_port(),
        log_path=f.tmp / f"{NODE}.log",
        port_range=(base, base + 63),
        token=f.token(),
        node_name=NODE,
        extra_env={
            "LLMGW_AGENT__SYNC_INTERVAL_S": "0.3",
            "LLMGW_AGENT__CPU_THREADS": "4",
            "LLMGW_AGENT__ENGINES": f'{{"llamacpp": {{"path": "{llama_server}"}}}}',
        },
    ).start()
    f.agents[NODE] = agent
    return agent


def _apply(f: GatewayFleet, document: Path) -> str:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")},
        "LLMGW_ADMIN_URL": f.cp.url,
        "LLMGW_ADMIN_TOKEN": f.admin_token,
    }
    done = subprocess.run(
        llmgw_cmd("apply", "-f", str(document)),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _by_replica(shards: list[ReadyShard]) -> dict[str, int]:
    return {s.replica_id: s.pid for s in shards}


def test_llama_server_deployment_serves_through_the_gateway_and_survives_kills(
    fleet: GatewayFleet, llama_server: str, tiny_gguf: Path
) -> None:
    f = fleet
    f.start_controlplane("cp")
    agent = _start_agent(f, llama_server)
    document = f.tmp / "tiny.yaml"
    document.write_text(_deployment_yaml(tiny_gguf))
    assert "deployment/tiny" in _apply(f, document)
    shards = f.wait_ready(MODEL, 2, timeout_s=90)
    assert len({s.pid for s in shards}) == 2
    # The pids the agents report are real llama-server processes.
    assert {Path(f"/proc/{s.pid}/comm").read_text().strip() for s in shards} == {"llama-server"}

    client = openai.OpenAI(
        base_url=f"{f.public['cp']}/v1", api_key=f.create_key("e2e"), max_retries=0, timeout=30
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello! How are you?"}], max_tokens=4
    )
    assert chat.usage is not None and chat.usage.prompt_tokens > 5
    assert 1 <= chat.usage.completion_tokens <= 4
    done = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=3)
    assert done.usage is not None and done.usage.prompt_tokens >= 4
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    # No KV events from llama.cpp: every decision is the approximate tier's or load's.
    assert metric_value(f.cp, "llmgw_prefix_decisions_total", tier="precise") == 0
    assert metric_value(f.cp, "llmgw_prefix_decisions_total") >= 3

    # kill -9 of an engine: its agent restarts it, and the gateway serves on.
    victim = shards[0]
    os.kill(victim.pid, signal.SIGKILL)
    restarted = f.until(
        lambda: (
            s
            if (s := f.ready_shards(MODEL)) and len(s) == 2 and victim.pid not in {x.pid for x in s}
            else None
        ),
        timeout_s=60,
        what="the killed llama-server restarted and ready",
    )
    assert not pid_alive(victim.pid)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)

    # kill -9 of the agent: the engines run on, and the restarted agent adopts them.
    before = _by_replica(restarted)
    agent.kill9()
    assert all(pid_alive(pid) for pid in before.values())
    client.completions.create(model=MODEL, prompt="Hello again", max_tokens=2)
    agent.start()
    wait_for(agent.health, timeout_s=60, what="the agent to answer /healthz again")
    f.until(
        lambda: sum(e.get("event") == "shard_adopted" for e in agent.log_events()) >= 2,
        timeout_s=30,
        what="both shards adopted",
    )
    after = f.until(
        lambda: s if len(s := f.ready_shards(MODEL)) == 2 else None,
        timeout_s=30,
        what="both replicas ready after the agent's restart",
    )
    assert _by_replica(after) == before, "the agent restarted engines instead of adopting them"
    client.completions.create(model=MODEL, prompt="Still here", max_tokens=2)
