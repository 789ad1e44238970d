"""Shared machinery of the gateway and routing benchmarks: real processes, timing, statistics.

Everything here starts real components and nothing stands in for them: a throwaway Postgres
(llmgw.embedded_postgres, migrated with the project's Alembic scripts), `llmgw controlplane`
processes on fixed ports (so a restart with another routing policy keeps the URLs the agents
and clients hold), and an aiohttp client that records, per request, the time to the first
streamed token, every chunk's arrival and the upstream `usage`.

Not a test harness: it raises on the first failure with the last lines of the process's log,
and every process it starts is stopped by `Stack.close` (the benches run it in `finally`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx

__all__ = [
    "ControlPlane",
    "Result",
    "Stack",
    "cpu_seconds",
    "free_port",
    "percentile",
    "post",
    "summarize",
    "wait_for",
]

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used, all threads.

    schedstat's first field (nanoseconds on a CPU, per thread) where the kernel has it:
    /proc/<pid>/stat counts clock ticks of 10 ms, too coarse for a phase of a few hundred
    requests. Falls back to utime + stime from /proc/<pid>/stat.
    """
    try:
        total_ns = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total_ns += int(f.read().split()[0])
        return total_ns / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # fields[11], fields[12]: utime and stime (fields 14 and 15 of proc(5)), in ticks.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def wait_for(
    condition: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
    check: Callable[[], None] | None = None,
) -> T:
    """Poll ``condition`` until truthy; ``check`` raises when a process it depends on died."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if check is not None:
            check()
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # not there yet: a server still starting
            last = exc
        time.sleep(interval_s)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for {what} (last error: {last!r})")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with self.log.open("ab") as out:
            # Own session: stop() signals the group, so a process's children go with it.
            # SIGTERM when the bench dies without its finally (SIGKILL, a test timeout).
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def check(self) -> None:
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.popen.returncode}:\n{_tail(self.log)}"
            )

    def stop(self, *, group: bool = True, timeout_s: float = 15) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(p.pid, signal.SIGTERM)
            else:
                p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL) if group else p.kill()
            p.wait()


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGTERM))


def base_env(**extra: str) -> dict[str, str]:
    """The caller's environment without LLMGW_* (a developer's settings must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


CP_LOG_ENV = {"LLMGW_LOG__JSON": "true", "LLMGW_LOG__LEVEL": "warning"}
# Short periods so a fleet settles in seconds (as the end-to-end tests run it).
CP_SHORT_PERIODS = {
    "LLMGW_CONTROLPLANE__RECONCILE__TICK_S": "0.5",
    "LLMGW_CONTROLPLANE__RECONCILE__SYNC_PERIOD_S": "0.5",
    "LLMGW_CONTROLPLANE__RECONCILE__NODE_GRACE_S": "5",
    "LLMGW_CONTROLPLANE__AGENT_API__NODE_REFRESH_S": "0",
    "LLMGW_CONTROLPLANE__AGENT_API__HEARTBEAT_FLUSH_S": "0.5",
    "LLMGW_CONTROLPLANE__AGENT_API__INSTANCE_HEARTBEAT_S": "0.5",
    "LLMGW_CONTROLPLANE__SHUTDOWN_GRACE_S": "3",
}


@dataclass
class ControlPlane:
    """One `llmgw controlplane` on fixed ports: restartable with other settings."""

    name: str
    db_url: str
    admin_token: str
    tmp: Path
    internal_port: int = field(default_factory=free_port)
    public_port: int = field(default_factory=free_port)
    proc: Proc | None = None
    short_periods: bool = True  # False: the control plane's own (production) periods

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.internal_port}"

    @property
    def public_url(self) -> str:
        return f"http://127.0.0.1:{self.public_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, **env: str) -> ControlPlane:
        full = base_env(**CP_LOG_ENV, **(CP_SHORT_PERIODS if self.short_periods else {}))
        full.update(
            LLMGW_CONTROLPLANE__DATABASE_URL=self.db_url,
            LLMGW_CONTROLPLANE__ADMIN_TOKEN=self.admin_token,
        )
        full.update(env)
        argv = [sys.executable, "-m", "llmgw", "controlplane"]
        argv += ["--port", str(self.internal_port), "--public-port", str(self.public_port)]
        self.proc = Proc(self.name, argv, full, self.tmp / f"{self.name}.log").start()
        wait_for(
            lambda: httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200,
            timeout_s=60,
            what=f"{self.name} /readyz",
            check=self.proc.check,
        )
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(group=False)

    def restart(self, **env: str) -> ControlPlane:
        self.stop()
        return self.start(**env)

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        r = httpx.request(
            method,
            f"{self.url}/admin/v1{path}",
            json=body,
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )
        if r.status_code >= 300:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:500]}")
        return r.json() if r.content else None

    def sim_deployment(self, name: str, *, replicas: int, **profile: Any) -> None:
        """A model, a one-GPU `sim` profile (``profile`` adds fields) and a deployment of it,
        all named ``name``."""
        self.admin("POST", "/models", {"name": name})
        sim = {"engine": "sim", "gpu_class": "sim", "model_path": name}
        self.admin("POST", "/profiles", {"name": name, "model": name, **sim, **profile})
        self.admin(
            "POST",
            "/deployments",
            {"name": name, "model": name, "profile": name, "replicas": replicas},
        )

    def create_key(self) -> str:
        """A new API key with no limits (POST /admin/v1/keys; the key is in this reply only)."""
        out = self.admin("POST", "/keys", {"name": f"bench-{secrets.token_hex(4)}"})
        return str(out["key"])

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text


@dataclass
class Stack:
    """The processes of one bench run and the database they share; close() stops them all."""

    tmp: Path
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    procs: list[Proc] = field(default_factory=list)
    controlplanes: list[ControlPlane] = field(default_factory=list)
    db_url: str = ""
    _pg: Any = None

    def start_postgres(self) -> str:
        # Imported here: the canned upstream and the floor proxy import this module too and
        # must not pay for SQLAlchemy and the control plane at start-up.
        from llmgw.embedded_postgres import EmbeddedPostgres
        from llmgw.store.migrations import upgrade

        self._pg = EmbeddedPostgres(throwaway=True)
        self._pg.start()
        self.db_url = str(self._pg.url)
        upgrade(self.db_url)
        return self.db_url

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, env or base_env(), self.tmp / f"{name}.log").start()
        self.procs.append(proc)
        return proc

    def controlplane(self, name: str, *, short_periods: bool = True, **env: str) -> ControlPlane:
        cp = ControlPlane(
            name, self.db_url, self.admin_token, self.tmp, short_periods=short_periods
        )
        self.controlplanes.append(cp)
        return cp.start(**env)

    def check(self) -> None:
        for p in self.procs:
            p.check()
        for cp in self.controlplanes:
            if cp.proc is not None:
                cp.proc.check()

    def close(self, *, failed: bool = False) -> None:
        """Stop everything; keep the logs dir (and say where) only when the run failed."""
        for p in reversed(self.procs):
            p.stop()
        for cp in self.controlplanes:
            cp.stop()
        if self._pg is not None:
            self._pg.stop()
        if failed:
            print(f"logs of the failed run: {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass
class Result:
    """One request as the client saw it (times in seconds from sending the request)."""

    ok: bool
    status: int
    latency_s: float
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: str = ""


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    keep_chunk_times: bool = False,
) -> Result:
    """POST an OpenAI request; for a stream, time the first token and (optionally) every chunk.

    The first *token* is the first chunk with non-empty content (OpenAI streams open with a
    role-only chunk); usage comes from the final chunk (stream_options.include_usage).
    """
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = await resp.text()
                return Result(False, resp.status, time.perf_counter() - t0, error=text[:300])
            if not body.get("stream"):
                data = await resp.json()
                return Result(True, 200, time.perf_counter() - t0, usage=data.get("usage"))
            ttft: float | None = None
            times: list[float] = []
            usage: dict[str, Any] | None = None
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter() - t0
                if keep_chunk_times:
                    times.append(now)
                if (
                    ttft is None
                    and (b'"content":"' in line or b'"text":"' in line)
                    and b'"content":""' not in line
                    and b'"text":""' not in line
                ):
                    ttft = now
                if b'"usage":{' in line:
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                elif b'"error"' in line and b'"choices"' not in line:
                    return Result(False, 200, now, ttft, times, error=line[:300].decode())
            return Result(True, 200, time.perf_counter() - t0, ttft, times, usage)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(False, 0, time.perf_counter() - t0, error=repr(exc)[:300])


def summarize(values: Sequence[float], scale: float = 1e3, digits: int = 3) -> dict[str, float]:
    """p50/p90/p99/mean of ``values`` in ms (by default), rounded."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": round(percentile(values, 50) * scale, digits),
        "p90": round(percentile(values, 90) * scale, digits),
        "p99": round(percentile(values, 99) * scale, digits),
        "mean": round(sum(values) / len(values) * scale, digits),
    }
