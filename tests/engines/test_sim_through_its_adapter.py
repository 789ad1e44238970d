"""The `sim` engine adapter's command, run as is, starts a working simulator.

This is the path the node agent takes for every simulated shard (and `llmgw up`'s demo): the
engines package builds the command, the process is exec'd with exactly that argv and
environment. A flag the adapter emits that the simulator does not take, or an environment
variable it does not read (API key, hash seed), fails here rather than on a fleet.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from llmgw.engines import (
    Adapter,
    EngineRegistry,
    EnginesConfig,
    KVHashParams,
    Profile,
    ShardSpec,
    SimConfig,
)
from llmgw.kv import block_hashes
from tests.support.procs import free_port, stop_process, wait_http_ok
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_the_adapters_command_serves_with_key_seed_and_adapters(tmp_path: Path) -> None:
    port = free_port()
    profile = Profile(
        name="demo-cpu",
        engine="sim",
        gpu_class="cpu",
        model_path="/models/demo",
        served_model_name="demo",
        adapters=(Adapter(name="sql", path="/adapters/sql"),),
        kv_events=True,
        kv_hash=KVHashParams(seed="3141592653", block_size=16),
        args=("--time-scale", "0.01"),
    )
    spec = ShardSpec(
        replica_id="r1",
        shard_id="s1",
        http_port=port,
        profile=profile,
        api_key="shard-key-0123456789",
        kv_events_port=free_port(),
        kv_replay_port=free_port(),
        threads=1,
    )
    registry = EngineRegistry(EnginesConfig(sim=SimConfig(python_executable=sys.executable)))
    engine = registry.get("sim")
    engine.validate(profile, [])
    (command,) = engine.commands(spec, base_env=dict(os.environ))
    assert "shard-key-0123456789" not in " ".join(command.args)
    log = tmp_path / "sim.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [command.path, *command.args], env=dict(command.env), stdout=out, stderr=out
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{base}{engine.health_path}", timeout_s=30, proc=proc, log=log)
        assert httpx.get(f"{base}/v1/models").status_code == 401  # the key arrived via env
        headers = {"Authorization": "Bearer shard-key-0123456789"}
        models = httpx.get(f"{base}/v1/models", headers=headers).json()
        assert [m["id"] for m in models["data"]] == ["demo", "sql"]
        prompt = " ".join(f"w{i}" for i in range(200))
        r = httpx.post(
            f"{base}/v1/completions",
            headers=headers,
            json={"model": "demo", "prompt": prompt, "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        # The engine hashes with the profile's seed: what it holds is what the router computes.
        tokens = httpx.post(f"{base}/tokenize", json={"prompt": prompt}).json()["tokens"]
        expected = {
            int.from_bytes(h[-8:], "big") for h in block_hashes(tokens, 16, seed="3141592653")
        }

        def held() -> set[int]:
            return {b["hash"] for b in httpx.get(f"{base}/debug/kv_blocks").json()["blocks"]}

        wait_for(lambda: expected <= held(), timeout_s=10, what="the prompt's blocks in the cache")
    finally:
        stop_process(proc)
