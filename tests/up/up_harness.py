"""`llmgw up` as a real process for tests: start it, wait for its up.json, find every process
it is responsible for by scanning /proc.

A process is ours when its command line names the data dir (Postgres, the agent, shard
wrappers), names the admin port (the control plane), or carries the LLMGW_SHARD_ID marker of
one of the shards the run placed (engines: their command line names neither). Other tests
run llmgw processes at the same time, so nothing here matches by program name alone.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from llmgw.nodeagent.procs import MARKER_ENV
from tests.support.procs import free_port, llmgw_cmd, stop_process
from tests.support.waiting import wait_for

__all__ = ["Up", "our_pids", "shard_ids", "shard_marker"]


@dataclass
class Up:
    data_dir: Path
    log_dir: Path
    port: int
    admin_port: int
    proc: subprocess.Popen[bytes] | None = None
    runs: int = 0

    @classmethod
    def new(cls, root: Path) -> Up:
        return cls(data_dir=root / "data", log_dir=root, port=free_port(), admin_port=free_port())

    @property
    def out(self) -> Path:
        return self.log_dir / f"up-{self.runs}.out"

    @property
    def err(self) -> Path:
        return self.log_dir / f"up-{self.runs}.err"

    def start(self, *extra: str, env: dict[str, str] | None = None) -> Up:
        """Start `llmgw up` with ``extra`` flags; ``env`` adds settings (its children inherit
        them: ``LLMGW_GATEWAY__HEADER_TIMEOUT_S``, ...)."""
        self.runs += 1
        argv = llmgw_cmd(
            "up",
            "--data-dir", str(self.data_dir),
            "--port", str(self.port),
            "--admin-port", str(self.admin_port),
            "--sim-gpus", "2",
            *extra,
        )  # fmt: skip
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=err,
                start_new_session=True,
                env={**os.environ, "LLMGW_LOG__JSON": "true", **(env or {})},
            )
        return self

    def logs(self) -> str:
        text = f"--- stdout:\n{self.out.read_text()[-3000:]}\n--- stderr:\n"
        text += self.err.read_text()[-3000:]
        for name in ("agent", "controlplane", "gateway"):
            path = self.data_dir / "logs" / f"{name}.log"
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()
                text += f"\n--- {name}.log:\n" + "\n".join(lines[-15:])
        return text

    def wait_up(self, timeout_s: float = 90) -> dict[str, Any]:
        proc = self.proc
        assert proc is not None

        def read() -> dict[str, Any] | None:
            if proc.poll() is not None:
                raise AssertionError(f"llmgw up exited with {proc.returncode}:\n{self.logs()}")
            path = self.data_dir / "up.json"
            if not path.exists():
                return None
            info: dict[str, Any] = json.loads(path.read_text())
            # A run killed outright leaves its up.json behind: only this process's counts.
            return info if info.get("pid") == proc.pid else None

        try:
            return wait_for(read, timeout_s=timeout_s, what="up.json", interval_s=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def stop(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        return stop_process(self.proc, sig=2, timeout_s=timeout_s)  # SIGINT: Ctrl-C

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def cli(self, *args: str, stdin: str | None = None) -> str:
        """``llmgw ARGS --data-dir <this run's>`` (its up.json names the endpoints and tokens);
        its stdout, after asserting it succeeded."""
        r = subprocess.run(
            llmgw_cmd(*args, "--data-dir", str(self.data_dir)),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 0, f"llmgw {' '.join(args)}: {r.stdout}{r.stderr}"
        return r.stdout

    def status_json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.cli("status", "--json"))
        return data


def shard_ids(info: dict[str, Any]) -> set[str]:
    """Every shard id the control plane knows (released ones included)."""
    r = httpx.get(
        f"{info['admin_url']}/admin/v1/replicas",
        params={"limit": 500},
        headers={"Authorization": f"Bearer {info['admin_token']}"},
        timeout=10,
    )
    r.raise_for_status()
    return {str(s["id"]) for rep in r.json()["items"] for s in rep["shards"]}


def _cmdline(pid: str) -> str:
    try:
        return (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def shard_marker(pid: str) -> str:
    try:
        env = (Path("/proc") / pid / "environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    prefix = f"{MARKER_ENV}=".encode()
    for item in env:
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return ""


def _zombie(pid: str) -> bool:
    try:
        stat = (Path("/proc") / pid / "stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :].startswith(b"Z")


def our_pids(up: Up, shards: set[str]) -> dict[int, str]:
    """pid -> command line of every live process this `llmgw up` is responsible for."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        pid = entry.name
        if not pid.isdigit() or int(pid) == os.getpid() or _zombie(pid):
            continue
        cmd = _cmdline(pid)
        mine = (
            str(up.data_dir) in cmd
            or f"--port {up.admin_port}" in cmd
            # `llmgw gateway` and its workers (the default --host)
            or f"gateway --host 127.0.0.1 --port {up.port}" in cmd
            or (bool(shards) and shard_marker(pid) in shards)
        )
        if mine:
            found[int(pid)] = cmd
    return found
