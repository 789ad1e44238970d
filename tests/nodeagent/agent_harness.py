"""Running `llmgw agent` as a real process against the protocol test server, for tests and bench.

Short periods (sync and health every 0.2 s, restart backoff from 0.2 s) keep
the tests quick; grace periods stay >= 5 sync periods (docs/architecture.md §10). Logs are
JSON lines in a file, which `log_events` reads back for assertions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from llmgw.protocol import DesiredShard

__all__ = ["AgentProcess", "sim_shard"]

FAST_ENV = {
    "LLMGW_AGENT__SYNC_INTERVAL_S": "0.2",
    "LLMGW_AGENT__HEALTH_INTERVAL_S": "0.2",
    "LLMGW_AGENT__SYNC_BACKOFF_MAX_S": "1.0",
    "LLMGW_AGENT__RESTART_BACKOFF_MIN_S": "0.3",
    "LLMGW_AGENT__RESTART_BACKOFF_MAX_S": "2.0",
    "LLMGW_AGENT__STOP_GRACE_S": "2.0",
    "LLMGW_AGENT__START_TIMEOUT_S": "60",
    "LLMGW_AGENT__SYNC_TIMEOUT_S": "2",
    "LLMGW_AGENT__PROXY_PORT": "0",
    "LLMGW_LOG__JSON": "true",
    "LLMGW_LOG__LEVEL": "info",
}


def sim_shard(
    shard_id: str,
    *,
    fingerprint: str = "fp-1",
    args: tuple[str, ...] = ("--time-scale", "0.01", "--num-blocks", "64"),
    desired_state: str = "running",
    key: str = "engine-key-0123456789",
    kv_events: bool = False,
    extra_profile: dict[str, Any] | None = None,
    extra_spec: dict[str, Any] | None = None,
) -> DesiredShard:
    profile: dict[str, Any] = {
        "name": "demo-sim",
        "engine": "sim",
        "gpu_class": "cpu",
        "model_path": "demo",
        "served_model_name": "demo",
        "args": list(args),
        "kv_events": kv_events,
    }
    if kv_events:
        profile["kv_hash"] = {"seed": "12345", "block_size": 16}
    profile.update(extra_profile or {})
    spec: dict[str, Any] = {
        "replica_id": f"r-{shard_id}",
        "shard_id": shard_id,
        "profile": profile,
        "threads": 1,
    }
    spec.update(extra_spec or {})
    return DesiredShard(
        shard_id=shard_id,
        replica_id=f"r-{shard_id}",
        desired_state=desired_state,  # type: ignore[arg-type]
        fingerprint=fingerprint,
        spec=spec,
        engine_api_key=key,
        model="demo",
    )


class AgentProcess:
    def __init__(
        self,
        *,
        state_dir: Path,
        controlplane_url: str,
        listen_port: int,
        log_path: Path,
        port_range: tuple[int, int],
        token: str = "boot-token-0123456789",
        node_name: str = "node-a",
        extra_env: dict[str, str] | None = None,
        sim_gpus: int = 0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.state_dir = state_dir
        self.log_path = log_path
        self.listen_port = listen_port
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update(FAST_ENV)
        # One range per agent (support.procs.agent_port_base), split: its top quarter for the
        # shards' front doors, the rest for engines, so no two agents of a test share a port.
        proxy_start = port_range[1] - (port_range[1] - port_range[0] + 1) // 4 + 1
        env.update(
            {
                "LLMGW_AGENT__BOOTSTRAP_TOKEN": token,
                "LLMGW_AGENT__PORT_RANGE_START": str(port_range[0]),
                "LLMGW_AGENT__PORT_RANGE_END": str(proxy_start - 1),
                "LLMGW_AGENT__PROXY_PORT_RANGE_START": str(proxy_start),
                "LLMGW_AGENT__PROXY_PORT_RANGE_END": str(port_range[1]),
                "LLMGW_AGENT__MGMT_ADDR": "127.0.0.1",
            }
        )
        env.update(extra_env or {})
        self.env = env
        self.argv = [
            sys.executable,
            "-m",
            "llmgw",
            "agent",
            "--controlplane-url",
            controlplane_url,
            "--state-dir",
            str(state_dir),
            "--node-name",
            node_name,
            "--listen-port",
            str(listen_port),
            "--sim-gpus",
            str(sim_gpus),
            *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=log, start_new_session=True
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def assert_alive(self) -> None:
        if not self.alive():
            raise AssertionError(f"agent exited:\n{self.log_path.read_text()[-4000:]}")

    def kill9(self) -> None:
        """SIGKILL the agent alone (not its session: engines must survive it)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def health(self) -> dict[str, Any]:
        r = httpx.get(f"http://127.0.0.1:{self.listen_port}/healthz", timeout=2)
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def log_events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and "event" in ev:
                out.append(ev)
        return out

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.log_events() if e.get("event") == name]
