"""Start and stop `llmgw simengine` as a real process on loopback, waiting for /health."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from support.procs import free_port

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
    deadline = time.monotonic() + deadline_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"simengine exited with {proc.returncode}:\n{sim.log()}")
            try:
                status = client.get(f"{sim.base_url}/health").status_code
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            sim.health_statuses.append(status)
            if status == 200:
                return sim
            time.sleep(0.05)
    stop_sim(sim)
    raise RuntimeError(f"simengine not healthy within {deadline_s}s:\n{sim.log()}")


def stop_sim(sim: SimProcess) -> None:
    if sim.proc.poll() is None:
        sim.proc.terminate()
        try:
            sim.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sim.proc.kill()
            sim.proc.wait()
