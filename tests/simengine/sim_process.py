"""Start and stop `llmgw simengine` as a real process on loopback, waiting for /health."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.procs import free_port
from tests.support.waiting import WaitTimeout, wait_for

API_KEY = "sim-test-key"
HASH_SEED = "4242"


@dataclass
class SimProcess:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    health_statuses: list[int] = field(default_factory=list)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_sim(
    tmp: Path, *args: str, env: dict[str, str] | None = None, deadline_s: float = 20
) -> SimProcess:
    port = free_port()
    log_path = tmp / f"sim-{port}.log"
    full_env = dict(os.environ)
    full_env.pop("SIMENGINE_API_KEY", None)  # only the keys a test passes
    full_env.update({"PYTHONHASHSEED": HASH_SEED, **(env or {})})
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmgw",
                "simengine",
                "--port",
                str(port),
                "--log-level",
                "info",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
    sim = SimProcess(f"http://127.0.0.1:{port}", proc, log_path)
    with httpx.Client(timeout=2) as client:

        def healthy() -> bool:
            assert proc.poll() is None, f"simengine exited with {proc.returncode}:\n{sim.log()}"
            status = client.get(f"{sim.base_url}/health").status_code  # refused: not yet
            sim.health_statuses.append(status)
            return status == 200

        try:
            wait_for(healthy, timeout_s=deadline_s, what="simengine's /health", interval_s=0.05)
        except WaitTimeout:
            stop_sim(sim)
            raise AssertionError(
                f"simengine not healthy within {deadline_s}s:\n{sim.log()}"
            ) from None
    return sim


def stop_sim(sim: SimProcess) -> None:
    if sim.proc.poll() is None:
        sim.proc.terminate()
        try:
            sim.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sim.proc.kill()
            sim.proc.wait()
