"""The real node agent against the real agent API: `llmgw agent --sim-gpus 2` registers with a
bootstrap token, syncs, runs a simulator shard the "reconciler" placed by SQL until it reports
it ready, then stops it when it is desired stopped, and the shard is released.

Real processes throughout: the agent, its `llmgw shard-run` wrapper and the simulator engine,
against uvicorn serving the agent API on a real Postgres.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from llmgw.nodeagent.procs import kill_marked
from tests.controlplane.agentapi.agentapi_testkit import (
    fetch,
    make_token,
    place_shard,
    running_agent_api,
    set_desired_state,
)
from tests.nodeagent.agent_harness import AgentProcess
from tests.support.procs import agent_port_base, free_port
from tests.support.waiting import WaitTimeout, until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

T = TypeVar("T")


async def _until(
    probe: Callable[[], Awaitable[T | None]], agent: AgentProcess, *, timeout_s: float, what: str
) -> T:
    async def alive_probe() -> T | None:
        agent.assert_alive()
        return await probe()

    try:
        return await until(alive_probe, timeout_s=timeout_s, what=what, interval_s=0.1)
    except WaitTimeout as exc:
        raise AssertionError(
            f"{exc}\n{agent.log_path.read_text(errors='replace')[-4000:]}"
        ) from None


def _sim_spec() -> dict[str, Any]:
    return {
        "replica_id": "set-by-the-control-plane",
        "shard_id": "set-by-the-control-plane",
        "profile": {
            "name": "demo-sim",
            "engine": "sim",
            "gpu_class": "sim",
            "model_path": "demo",
            "served_model_name": "demo",
            "args": ["--time-scale", "0.01", "--num-blocks", "64"],
        },
    }


async def test_the_real_agent_registers_syncs_and_runs_a_sim_shard(
    db_url: str, tmp_path: Path
) -> None:
    base = agent_port_base()
    shard = ""
    async with running_agent_api(db_url) as cp:
        token = await make_token(cp.sessions, uses=1, pool="sim")
        agent = AgentProcess(
            state_dir=tmp_path / "state",
            controlplane_url=cp.base_url,
            listen_port=free_port(),
            log_path=tmp_path / "agent.log",
            port_range=(base, base + 63),
            token=token,
            node_name="e2e-node",
            sim_gpus=2,
        ).start()
        try:

            async def registered() -> Any:
                rows = await fetch(
                    cp.sessions,
                    "SELECT n.id, n.pool, s.inventory, s.last_sync_at FROM nodes n "
                    "JOIN node_status s ON s.node_id = n.id WHERE n.name = 'e2e-node' "
                    "AND s.last_sync_at IS NOT NULL",
                )
                return rows[0] if rows else None

            node = await _until(registered, agent, timeout_s=30, what="register and sync")
            assert node.pool == "sim"
            assert [g["gpu_class"] for g in node.inventory["gpus"]] == ["sim", "sim"]

            shard = await place_shard(
                cp.sessions, str(node.id), gpus=(1,), model="demo", spec=_sim_spec()
            )

            async def ready() -> Any:
                rows = await fetch(
                    cp.sessions,
                    "SELECT observed_state, observed_reason, pid, proxy_url, http_port "
                    "FROM shards WHERE id = :id AND observed_state = 'ready'",
                    id=shard,
                )
                return rows[0] if rows else None

            row = await _until(ready, agent, timeout_s=60, what="the shard to be ready")
            assert row.pid and row.proxy_url.endswith(f"/shards/{shard}")
            # The engine answers through the agent's proxy with the shard's key.
            async with httpx.AsyncClient(timeout=5) as http:
                r = await http.get(
                    row.proxy_url + "/v1/models",
                    headers={"Authorization": "Bearer engine-key"},
                )
                assert r.status_code == 200, r.text

            await set_desired_state(cp.sessions, shard, "stopped")

            async def released() -> Any:
                rows = await fetch(
                    cp.sessions, "SELECT released FROM shards WHERE id = :id", id=shard
                )
                return rows[0].released

            await _until(released, agent, timeout_s=60, what="the stopped shard's release")
            gpus = await fetch(
                cp.sessions,
                "SELECT shard_released FROM gpu_assignments WHERE shard_id = :id",
                id=shard,
            )
            assert [g.shard_released for g in gpus] == [True]
        finally:
            agent.terminate()
            if shard:
                kill_marked(shard)
