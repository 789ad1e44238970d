"""Runtime LoRA adapters through the whole agent: `llmgw agent` + wrappers + simulator engines as
real processes, against the protocol test server. The placement arrives in a sync
(DesiredShard.adapters) and comes back in the bindings (ShardBinding.adapters); the engine is
never restarted for it; an agent killed and started again reports the adapters from its first
sync and loads nothing again; an engine that restarts gets them loaded again."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from llmgw.protocol import DesiredShard, ShardBinding
from llmgw.protocol.sync import AdapterObserved, RuntimeAdapter
from tests.nodeagent.agent_harness import AgentProcess, sim_shard
from tests.nodeagent.protocol_server import ProtocolServer
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

Factory = Callable[..., AgentProcess]
Ids = Callable[[str], str]
KEY = "engine-key-0123456789"
FAST_ADAPTERS = {"LLMGW_AGENT__ADAPTER_RETRY_MIN_S": "0.2", "LLMGW_AGENT__ADAPTER_RETRY_MAX_S": "1"}


def _shard(sid: str, adapters: list[RuntimeAdapter]) -> DesiredShard:
    d = sim_shard(sid, extra_profile={"adapter_slots": 2})
    return d.model_copy(update={"adapters": tuple(adapters)})


def _dir(tmp: Path, name: str) -> str:
    d = tmp / "adapters" / name
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def _binding(cp: ProtocolServer, agent: AgentProcess, sid: str) -> ShardBinding | None:
    agent.assert_alive()
    return cp.bindings("node-a").get(sid)


def _wait_adapters(
    cp: ProtocolServer,
    agent: AgentProcess,
    sid: str,
    want: dict[str, str],
    *,
    timeout_s: float = 30,
) -> ShardBinding:
    def ok() -> ShardBinding | None:
        b = _binding(cp, agent, sid)
        if b is None or b.observed_state != "ready":
            return None
        return b if {a.name: a.state for a in b.adapters} == want else None

    try:
        return wait_for(ok, timeout_s=timeout_s, what=f"{sid}'s adapters {want}")
    except AssertionError:
        b = cp.bindings("node-a").get(sid)
        raise AssertionError(
            f"wanted {want}, have {b}\n{agent.log_path.read_text()[-3000:]}"
        ) from None


def _engine_holds(b: ShardBinding) -> set[str]:
    r = httpx.get(
        f"http://127.0.0.1:{b.http_port}/v1/models",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=5,
    )
    r.raise_for_status()
    return {m["id"] for m in r.json()["data"] if m.get("parent")}


def test_placed_adapters_follow_the_sync_survive_the_agent_and_come_back_after_the_engine(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids, tmp_path: Path
) -> None:
    s = shard_ids("lora")
    sql, chat = _dir(tmp_path, "sql"), _dir(tmp_path, "chat")
    agent = agent_factory(extra_env=FAST_ADAPTERS)
    wait_for(lambda: agent.assert_alive() or cp.nodes, timeout_s=20, what="registration")
    cp.set_desired("node-a", [_shard(s, [RuntimeAdapter(name="sql", path=sql)])])
    first = _wait_adapters(cp, agent, s, {"sql": "loaded"})
    assert first.adapters == (AdapterObserved(name="sql", state="loaded"),)
    assert _engine_holds(first) == {"sql"}

    # A new placement loads and unloads in the running engine: same process, no restart.
    cp.set_desired("node-a", [_shard(s, [RuntimeAdapter(name="chat", path=chat)])])
    moved = _wait_adapters(cp, agent, s, {"chat": "loaded"})
    assert (moved.pid, moved.restarts) == (first.pid, 0)
    assert _engine_holds(moved) == {"chat"}
    both = [RuntimeAdapter(name="sql", path=sql), RuntimeAdapter(name="chat", path=chat)]
    cp.set_desired("node-a", [_shard(s, both)])
    before = _wait_adapters(cp, agent, s, {"sql": "loaded", "chat": "loaded"})

    # The agent dies; its successor reports the adapters from its very first sync (before it
    # could ask the engine) and, having asked, loads nothing again.
    first_epoch = cp.node("node-a").epoch_seq[0]
    agent.kill9()
    n_before = len(cp.history("node-a"))
    agent2 = agent_factory(extra_env=FAST_ADAPTERS)

    def new_epoch_report() -> ShardBinding | None:
        agent2.assert_alive()
        for req in cp.history("node-a")[n_before:]:
            if req.agent_epoch > first_epoch:
                return next(b for b in req.bindings if b.shard_id == s)
        return None

    report = wait_for(new_epoch_report, timeout_s=20, what="the restarted agent's first sync")
    assert {a.name: a.state for a in report.adapters} == {"sql": "loaded", "chat": "loaded"}
    listed = wait_for(
        lambda: agent2.events("adapters_listed"), timeout_s=20, what="the engine's adapters read"
    )
    assert listed[0]["held"] == ["chat", "sql"]
    adopted = _wait_adapters(cp, agent2, s, {"sql": "loaded", "chat": "loaded"})
    assert adopted.pid == before.pid
    assert agent2.events("adapter_loaded") == []

    # The engine dies: the shard restarts, and a new process holds none of them until loaded.
    os.kill(adopted.pid or 0, signal.SIGKILL)

    def reloaded() -> ShardBinding | None:
        b = _binding(cp, agent2, s)
        if b is None or b.pid == adopted.pid or b.observed_state != "ready":
            return None
        return (
            b
            if {a.name: a.state for a in b.adapters} == {"sql": "loaded", "chat": "loaded"}
            else None
        )

    again = wait_for(reloaded, timeout_s=40, what="the restarted engine's adapters loaded again")
    assert again.restarts == 1
    assert _engine_holds(again) == {"sql", "chat"}
    assert sorted(e["adapter"] for e in agent2.events("adapter_loaded")) == ["chat", "sql"]


def test_front_doors_refuse_the_runtime_lora_routes(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids, tmp_path: Path
) -> None:
    s = shard_ids("door")
    agent = agent_factory(extra_env=FAST_ADAPTERS)
    wait_for(lambda: agent.assert_alive() or cp.nodes, timeout_s=20, what="registration")
    cp.set_desired("node-a", [_shard(s, [])])
    b = wait_for(
        lambda: (x := _binding(cp, agent, s)) and x.proxy_url and x.observed_state == "ready" and x,
        timeout_s=30,
        what="the shard behind its front door",
    )
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "evil", "lora_path": str(tmp_path)}
    for path in ("/v1/load_lora_adapter", "/v1/%6coad_lora_adapter", "/v1/unload_lora_adapter"):
        r = httpx.post(f"{b.proxy_url}{path}", json=body, headers=auth, timeout=5)
        assert r.status_code == 404, path
    # The engine serves them, to the agent on loopback; the gateways' routes still pass.
    assert httpx.get(f"{b.proxy_url}/v1/models", headers=auth, timeout=5).status_code == 200
    assert "evil" not in _engine_holds(b)


def test_a_load_is_reported_at_once_not_at_the_next_sync(
    cp: ProtocolServer, agent_factory: Factory, shard_ids: Ids, tmp_path: Path
) -> None:
    """Requests for an adapter wait in the gateways until the control plane hears it loaded:
    the agent syncs as soon as a load is answered, not a period later. The period here is
    30 s (jittered to at least 24 s); the report must come well before it."""
    s = shard_ids("early")
    sql = _dir(tmp_path, "sql")
    first = agent_factory()
    wait_for(lambda: first.assert_alive() or cp.nodes, timeout_s=20, what="registration")
    first.terminate()
    # The node is known with nothing to run; the next agent on its state finds its placement
    # in its very first sync, then waits a whole period for the next one, unless poked.
    cp.set_desired("node-a", [_shard(s, [RuntimeAdapter(name="sql", path=sql)])])
    slow = agent_factory(extra_env={**FAST_ADAPTERS, "LLMGW_AGENT__SYNC_INTERVAL_S": "30"})
    _wait_adapters(cp, slow, s, {"sql": "loaded"}, timeout_s=18)
    assert len(slow.events("adapter_loaded")) == 1
