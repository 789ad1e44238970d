"""The node agent's acceptance against the REAL control plane: `llmgw controlplane` (reconciler
on) on a throwaway Postgres, `llmgw agent --sim-gpus 3`, and the simulator engines the
reconciler placed through a deployment of a `sim` profile with kv_events.

Every KV check compares the control plane's own prefix index for a shard
(`GET /admin/v1/debug/kv/{shard}`) with the engine's own block set (the simulator's
`/debug/kv_blocks`), hash by hash per medium, and requires the view complete and not partial.

- kill -9 the agent while three engines run, requests while it is down, start it again: same
  engine processes, none restarted, all ready again at once, and the control plane's view of
  each engine equal to the engine's after the requests it missed (forward fill from replay).
- Then, on the same fleet: a burst of concurrent requests with duplicate blocks in play, an
  engine killed with SIGKILL (the supervisor restarts it, the mirror resets), and a control
  plane restart (a new instance with an empty index: full copies rebuild it).
- Dropped frames (a gap) are forced inside the relay, which a process cannot be asked to do:
  an in-process `KvRelay` with a frame filter feeds the real control plane over real HTTP with
  a real node credential, for a shard the control plane placed on that node.
"""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from llmgw.nodeagent.kvrelay.relay import KvRelay
from llmgw.nodeagent.kvrelay.stream import StreamTiming
from llmgw.nodeagent.procs import kill_marked
from llmgw.protocol.sync import (
    REGISTER_PATH,
    SYNC_PATH,
    GpuDevice,
    NodeInventory,
    RegisterRequest,
    SyncRequest,
)
from tests.nodeagent.agent_harness import AgentProcess
from tests.nodeagent.realcp import RealControlPlane, engine_blocks, kv_agreement, sim_deployment
from tests.simengine.sim_process import start_sim, stop_sim
from tests.support.procs import agent_port_base, free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]


class Fleet:
    """A deployment's shards as the control plane records them, and ways to load them."""

    def __init__(self, cp: RealControlPlane, deployment: str) -> None:
        self.cp = cp
        self.deployment = deployment
        self.http = httpx.Client(timeout=30)

    def ready(self, n: int) -> list[dict[str, Any]] | None:
        self.cp.assert_alive()
        shards = self.cp.shards(self.deployment)
        ok = len(shards) == n and all(s["state"] == "ready" and s["pid"] for s in shards)
        return shards if ok else None

    def key(self, shard_id: str) -> str:
        key: str = self.cp.sql("SELECT engine_api_key FROM shards WHERE id = %s", (shard_id,))[0][0]
        return key

    def complete(self, shard: dict[str, Any], prompt: str, max_tokens: int = 4) -> None:
        r = self.http.post(
            f"http://127.0.0.1:{shard['http_port']}/v1/completions",
            headers={"Authorization": f"Bearer {self.key(shard['id'])}"},
            json={"model": self.deployment, "prompt": prompt, "max_tokens": max_tokens},
        )
        assert r.status_code == 200, r.text

    def burst(self, shards: list[dict[str, Any]], tag: str, n: int = 8) -> None:
        """``n`` concurrent requests per engine: shared and distinct prefixes, evicting."""
        jobs = [
            (s, f"{tag} topic {i % 3} " + "lorem ipsum dolor " * (4 + i % 5))
            for s in shards
            for i in range(n)
        ]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda j: self.complete(*j), jobs))

    def duplicates(self, shard: dict[str, Any]) -> None:
        """Two identical prompts scheduled in one step hold two physical blocks per hash (as
        vLLM does): paused, both queued, unpaused."""
        base = f"http://127.0.0.1:{shard['http_port']}"
        assert self.http.post(f"{base}/pause").json() == {"state": "paused"}
        with ThreadPoolExecutor(2) as pool:
            twins = [pool.submit(self.complete, shard, "twin prompt " * 12) for _ in range(2)]
            wait_for(
                lambda: self.http.get(f"{base}/debug/kv_blocks").json()["counts"]["waiting"] >= 2,
                timeout_s=10,
                what="both twins queued",
            )
            self.http.post(f"{base}/unpause")
            for t in twins:
                t.result()
        blocks = engine_blocks(shard["http_port"])
        # Duplicates in play (an earlier identical prompt may hold a third reference).
        assert blocks is not None and max(blocks.values()) >= 2, "no duplicate blocks"

    def agree(self, shards: list[dict[str, Any]], timeout_s: float = 20) -> None:
        for s in shards:
            wait_for(
                lambda s=s: (
                    kv_agreement(self.cp, s["id"], s["http_port"]) is None or self._complain(s)
                ),
                timeout_s=timeout_s,
                what=f"the control plane's KV view of {s['id']} to equal the engine's",
            )

    def _complain(self, shard: dict[str, Any]) -> bool:
        # wait_for keeps the last exception: make the last difference the message.
        raise RuntimeError(kv_agreement(self.cp, shard["id"], shard["http_port"]))


def _agent(cp: RealControlPlane, tmp_path: Path, listen: int, base: int, n: int) -> AgentProcess:
    return AgentProcess(
        state_dir=tmp_path / "state",
        controlplane_url=cp.url,
        listen_port=listen,
        log_path=tmp_path / f"agent-{n}.log",
        port_range=(base, base + 63),
        token=cp.bootstrap_token(),
        node_name="kv-node",
        sim_gpus=3,
    )


def test_agent_kill9_adopts_and_kv_view_survives_everything(
    realcp: RealControlPlane, tmp_path: Path
) -> None:
    cp, fleet = realcp, Fleet(realcp, "kvdemo")
    listen, base = free_port(), agent_port_base()
    agent = _agent(cp, tmp_path, listen, base, 0).start()
    agents = [agent]
    shard_ids: list[str] = []
    try:
        cp.apply(sim_deployment("kvdemo", replicas=3))
        before = wait_for(
            lambda: agent.assert_alive() or fleet.ready(3),
            timeout_s=60,
            what="three engines placed by the reconciler and ready",
        )
        shard_ids[:] = [s["id"] for s in before]
        fleet.burst(before, "warm")
        fleet.agree(before)

        # The relay's mirrors, persisted where a restarted agent looks for them.
        mirrors = tmp_path / "state" / "kv"
        wait_for(
            lambda: len(list(mirrors.glob("*.mirror"))) == 3, timeout_s=10, what="3 mirrors saved"
        )
        # kill -9 the agent; the engines keep serving, requests reach them meanwhile.
        epoch = cp.sql("SELECT agent_epoch FROM node_status")[0][0]
        agent.kill9()
        fleet.burst(before, "while the agent is down", n=4)
        agent = _agent(cp, tmp_path, listen, base, 1)
        agents.append(agent)
        agent.start()
        wait_for(
            lambda: (
                agent.assert_alive() or cp.sql("SELECT agent_epoch FROM node_status")[0][0] > epoch
            ),
            timeout_s=20,
            what="the restarted agent's first sync",
        )
        # Ready at once: adoption needs the first answer only, health is already known.
        after = wait_for(lambda: fleet.ready(3), timeout_s=3, what="all ready within one sync")
        assert [(s["id"], s["pid"], s["restarts"]) for s in after] == [
            (s["id"], s["pid"], s["restarts"]) for s in before
        ]
        wait_for(lambda: len(agent.events("shard_adopted")) == 3, timeout_s=5, what="adoptions")
        assert agent.events("shard_started") == []
        fleet.agree(after)
        # Filled forward from each engine's replay, not rebuilt blind.
        assert len(agent.events("kv_forward_filled")) == 3

        # A burst with duplicate blocks in play, then eviction of one twin.
        fleet.duplicates(after[0])
        fleet.burst(after, "burst")
        fleet.agree(after)

        # kill -9 an engine: the supervisor restarts it, the mirror resets, the view follows.
        victim = after[1]
        os.kill(victim["pid"], signal.SIGKILL)

        def restarted() -> list[dict[str, Any]] | None:
            now = fleet.ready(3)
            mine = [s for s in now or [] if s["id"] == victim["id"]]
            return now if mine and mine[0]["pid"] != victim["pid"] else None

        after = wait_for(restarted, timeout_s=30, what="the killed engine restarted and ready")
        fleet.burst([s for s in after if s["id"] == victim["id"]], "second life", n=4)
        fleet.agree(after)
        resets = [e for e in agent.events("kv_mirror_reset") if e.get("shard") == victim["id"]]
        assert resets, "the relay never reset the restarted engine's mirror"

        # The control plane restarts: its index starts empty; full copies rebuild it.
        cp.kill()
        cp.start()
        fleet.agree(after)
        fleet.burst(after, "after the control plane restart", n=3)
        fleet.agree(after)
    finally:
        for a in agents:
            a.terminate()
        for sid in shard_ids:
            kill_marked(sid)
        fleet.http.close()


# --- a gap, forced inside an in-process relay ----------------------------------------------


def _sim_inventory() -> NodeInventory:
    return NodeInventory(
        gpus=(GpuDevice(index=0, uuid="GPU-gap-0", name="sim", gpu_class="sim", simulated=True),),
        cpu_threads=4,
        source="sim",
    )


class Dropper:
    """The relay's frame filter: loses the next ``n`` live frames, as an overflowing HWM would."""

    def __init__(self) -> None:
        self.n = 0
        self.dropped: list[int] = []

    def __call__(self, shard: str, seq: int) -> bool:
        if self.n > 0:
            self.n -= 1
            self.dropped.append(seq)
            return False
        return True


async def test_relay_fills_a_gap_and_the_real_control_plane_stays_equal(
    realcp: RealControlPlane, tmp_path: Path
) -> None:
    cp = realcp
    # The debug view: admin token only; a shard it holds nothing for is a 404 that says why.
    async with httpx.AsyncClient(base_url=f"{cp.url}/admin/v1", timeout=10) as admin:
        path = "/debug/kv/no-such-shard"
        unknown = await admin.get(path, headers={"Authorization": f"Bearer {cp.token}"})
        assert unknown.status_code == 404 and "no KV view" in unknown.json()["error"]["message"]
        assert (await admin.get(path)).status_code == 401
    # A node registered and synced as an agent would, and a shard the reconciler placed on it
    # (a deployment whose one replica can only go to this node's one sim GPU).
    body = RegisterRequest(
        bootstrap_token=cp.bootstrap_token(),
        node_name="gap-node",
        mgmt_addr="127.0.0.1",
        inventory=_sim_inventory(),
        agent_version="test",
    )
    async with httpx.AsyncClient(base_url=cp.url, timeout=10) as http:
        r = await http.post(REGISTER_PATH, content=body.model_dump_json())
        assert r.status_code == 200, r.text
        credential, node_id = r.json()["node_credential"], r.json()["node_id"]

        async def sync(seq: int) -> None:
            # What the agent's sync loop sends: the reconciler places only on syncing nodes,
            # and a sync teaches this instance at once where the node's shards are.
            req = SyncRequest(node_id=node_id, agent_epoch=1, seq=seq, inventory=_sim_inventory())
            r = await http.post(
                SYNC_PATH,
                content=req.model_dump_json(),
                headers={"Authorization": f"Bearer {credential}"},
            )
            assert r.status_code == 200, r.text

        await sync(1)
        cp.apply(sim_deployment("gapdemo", replicas=1))
        shard = await asyncio.to_thread(
            wait_for, lambda: cp.shards("gapdemo"), timeout_s=20, what="the shard placed"
        )
        await sync(2)
    shard_id = shard[0]["id"]
    model = cp.sql(
        "SELECT launch_spec->'profile'->>'model' FROM shards WHERE id = %s", (shard_id,)
    )[0][0]

    sub_port, replay_port = free_port(), free_port()
    dropper = Dropper()
    registry = CollectorRegistry()
    relay = KvRelay(
        state_dir=tmp_path / "relay",
        auth_header=lambda: f"Bearer {credential}",
        registry=registry,
        max_sends_per_s=50,
        keepalive_s=0.3,
        timing=StreamTiming(full_copy_jitter_s=0.1, retry_min_s=0.05, retry_max_s=0.5),
        probe_interval_s=0.5,
        persist_interval_s=0.2,
        frame_filter=dropper,
    )
    await relay.start()
    sim = None
    try:
        relay.set_instances([("cp", cp.url)])
        relay.watch(shard_id, sub_port=sub_port, replay_port=replay_port, model=model,
                    engine_generation=1)  # fmt: skip
        config = (
            '{"enable_kv_cache_events": true, "publisher": "zmq", '
            f'"endpoint": "tcp://127.0.0.1:{sub_port}", '
            f'"replay_endpoint": "tcp://127.0.0.1:{replay_port}", "topic": "kv@{shard_id}"}}'
        )
        sim = await asyncio.to_thread(
            start_sim, tmp_path, "--block-size", "16", "--num-blocks", "64",
            "--time-scale", "0.02", "--kv-events-config", config,
        )  # fmt: skip
        port = int(sim.base_url.rsplit(":", 1)[1])

        async def agree() -> None:
            # The sync heartbeat of a real agent is missing here, so the placed cache learns
            # the shard by its periodic refresh (placed_refresh_s): the first deltas may be
            # answered retry until then.
            await asyncio.to_thread(
                wait_for,
                lambda: kv_agreement(cp, shard_id, port) is None,
                timeout_s=20,
                what="the control plane's view equal to the engine's",
            )

        async with httpx.AsyncClient(timeout=30) as http:

            async def complete(prompt: str) -> None:
                r = await http.post(
                    f"{sim.base_url}/v1/completions",
                    json={"model": "sim-model", "prompt": prompt, "max_tokens": 4},
                )
                assert r.status_code == 200, r.text

            await asyncio.gather(*(complete(f"warm {i} " + "lorem " * 20) for i in range(6)))
            await agree()
            dropper.n = 2
            for i in range(4):
                await complete(f"gap {i} " + "consectetur " * 20)
            await agree()
            assert len(dropper.dropped) == 2
            filled = registry.get_sample_value(
                "llmgw_agent_kv_gaps_total", {"shard": shard_id, "outcome": "filled"}
            )
            assert filled and filled >= 1
    finally:
        await relay.close()
        if sim is not None:
            await asyncio.to_thread(stop_sim, sim)
