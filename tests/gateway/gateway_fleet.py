"""The e2e fleet (tests/e2e/fleet_harness.py) plus what the gateway tests need: control planes
whose public (OpenAI) listener address is known and kept across a restart, so agents and
clients reach the restarted process at the same addresses."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field

import httpx

from tests.e2e.fleet_harness import _CP_ENV, ControlPlaneProc, Fleet
from tests.support.procs import free_port, llmgw_cmd, wait_http_ok

__all__ = ["GatewayFleet", "metric_value"]

# Precise routing's tokenize budget is 20 ms in production; on two shared cores under a test
# run a call can take longer, and a skipped tokenize is a legitimate approximate decision
# that would make the assertions below about precise decisions flaky.
GATEWAY_ENV = {
    "LLMGW_GATEWAY__TOKENIZE_TIMEOUT_S": "1.0",
    "LLMGW_GATEWAY__LOAD_SCRAPE_S": "0.2",
    # These tests restart the control plane, which takes longer than the e2e harness's 2 s
    # node grace: a new leader would judge the (healthy) node lost, from syncs it could not
    # receive while down, and replace every replica.
    "LLMGW_CONTROLPLANE__RECONCILE__NODE_GRACE_S": "30",
}


@dataclass
class GatewayFleet(Fleet):
    public: dict[str, str] = field(default_factory=dict)  # control plane name -> public URL
    ports: dict[str, tuple[int, int]] = field(default_factory=dict)

    def start_controlplane(self, name: str, **env: str) -> ControlPlaneProc:
        internal, public = self.ports.setdefault(name, (free_port(), free_port()))
        log = self.tmp / f"{name}.log"
        full = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        full.update(_CP_ENV)
        full.update(GATEWAY_ENV)
        full.update(
            LLMGW_CONTROLPLANE__DATABASE_URL=self.db_url,
            LLMGW_CONTROLPLANE__ADMIN_TOKEN=self.admin_token,
        )
        full.update(env)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                llmgw_cmd("controlplane", "--port", str(internal), "--public-port", str(public)),
                env=full,
                stdout=out,
                stderr=out,
            )
        cp = ControlPlaneProc(name=name, url=f"http://127.0.0.1:{internal}", proc=proc, log=log)
        self.controlplanes = [c for c in self.controlplanes if c.name != name] + [cp]
        self.public[name] = f"http://127.0.0.1:{public}"
        wait_http_ok(f"{cp.url}/readyz", timeout_s=60, proc=proc, log=log)
        wait_http_ok(f"{self.public[name]}/healthz", timeout_s=30, proc=proc, log=log)
        return cp

    def sim_kv_deployment(self, name: str, *, replicas: int, args: list[str]) -> None:
        """A model, a one-GPU `sim` profile with kv_events and a deployment of it."""
        self.admin("POST", "/models", {"name": name})
        self.admin(
            "POST",
            "/profiles",
            {
                "name": name,
                "model": name,
                "engine": "sim",
                "gpu_class": "sim",
                "model_path": name,
                "kv_events": True,
                "args": args,
            },
        )
        self.admin(
            "POST",
            "/deployments",
            {"name": name, "model": name, "profile": name, "replicas": replicas},
        )

    def create_key(self, name: str, **fields: object) -> str:
        return str(self.admin("POST", "/keys", {"name": name, **fields})["key"])


def metric_value(cp: ControlPlaneProc, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    text = httpx.get(f"{cp.url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
