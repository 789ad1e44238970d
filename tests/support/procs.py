"""Real processes and ports for tests: free ports, the `llmgw` command, waiting for a server's
HTTP answer, stopping a process."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.waiting import WaitTimeout, wait_for

__all__ = ["free_port", "llmgw_cmd", "stop_process", "wait_http_ok"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PORT_SIZE = 64
_PORT_BASES = list(range(20000, 32768 - _PORT_SIZE, _PORT_SIZE))
# Handed out in turn from a random start: random, so two suites on one machine rarely meet; in
# turn, so two agents of one test never share a range (drawn independently, two of ~200
# ranges collided in CI: both engines took one port, and one health check reached the other's
# engine).
_start = random.randrange(len(_PORT_BASES))
_port_bases = itertools.cycle(_PORT_BASES[_start:] + _PORT_BASES[:_start])


def agent_port_base(size: int = _PORT_SIZE) -> int:
    """The first port of a range for an agent's shards, below Linux's ephemeral range (32768+):
    free_port() and every outgoing connection of the suite take ports up there, and an engine
    whose port was taken in between crash-loops on "address already in use"."""
    if size > _PORT_SIZE:
        raise ValueError(f"agent port ranges are {_PORT_SIZE} ports at most")
    return next(_port_bases)


def llmgw_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmgw", *args]


def wait_http_ok(
    url: str,
    *,
    timeout_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    def tail() -> str:
        return log.read_text()[-3000:] if log is not None and log.exists() else ""

    def ready() -> bool:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"process exited with {proc.returncode} before {url} was ready:\n{tail()}"
            )
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout_s=timeout_s, what=f"{url} to answer 200")
    except WaitTimeout as exc:
        raise AssertionError(f"{url} not ready after {timeout_s}s:\n{tail()}") from exc


def stop_process(
    proc: subprocess.Popen[bytes], *, sig: int = signal.SIGTERM, timeout_s: float = 15
) -> int:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig) if _own_group(proc) else proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def _own_group(proc: subprocess.Popen[bytes]) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False
