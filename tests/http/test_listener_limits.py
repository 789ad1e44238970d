"""The bounds every listener applies before a request reaches its app (llmgw/http/listeners.py),
against a real `llmgw controlplane` (both listeners) and a real `llmgw simengine`: a head past
its cap is answered 431 and the process keeps serving; trickled heads and idle connections
are closed at the header timeout; at the connection cap idle connections make room for a
health check, and only when every connection is inside a request are new ones refused."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.simengine.sim_process import start_sim, stop_sim
from tests.support.procs import free_port, llmgw_cmd, stop_process, wait_http_ok
from tests.support.raw_http import closed_within, connect, exchange, status
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

BIG_HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"


@dataclass(frozen=True)
class _Cp:
    internal_port: int
    public_port: int
    token: str
    log: Path

    @property
    def internal(self) -> str:
        return f"http://127.0.0.1:{self.internal_port}"


@pytest.fixture
def start_cp(db_url: str, tmp_path: Path) -> Iterator[Callable[..., _Cp]]:
    with ExitStack() as stack:

        def start(**env: str) -> _Cp:
            return stack.enter_context(_controlplane(db_url, tmp_path, env))

        yield start


@contextmanager
def _controlplane(db_url: str, tmp_path: Path, extra_env: dict[str, str]) -> Iterator[_Cp]:
    token = secrets.token_urlsafe(24)
    port, public_port = free_port(), free_port()
    log = tmp_path / f"cp-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(
        LLMGW_CONTROLPLANE__DATABASE_URL=db_url,
        LLMGW_CONTROLPLANE__ADMIN_TOKEN=token,
        LLMGW_LOG__JSON="true",
        **extra_env,
    )
    argv = llmgw_cmd(
        "controlplane", "--port", str(port), "--public-host", "127.0.0.1",
        "--public-port", str(public_port),
    )  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/readyz", timeout_s=30, proc=proc, log=log)
        yield _Cp(port, public_port, token, log)
    finally:
        stop_process(proc)


def _healthz_within(port: int, seconds: float) -> None:
    started = time.monotonic()
    r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=seconds)
    assert r.status_code == 200, r.text
    assert time.monotonic() - started < seconds


def test_a_head_past_the_cap_is_answered_431_on_both_listeners(
    start_cp: Callable[..., _Cp],
) -> None:
    cp = start_cp()
    for port, setting in (
        (cp.internal_port, b"controlplane.max_header_bytes"),
        (cp.public_port, b"gateway.max_header_bytes"),
    ):
        answer = exchange(port, BIG_HEAD)
        assert status(answer) == 431, answer[:200]
        assert b"connection: close" in answer and setting in answer
        # A head under the cap is served as before, and the process is not stalled.
        fits = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Ok: " + b"a" * 60_000 + b"\r\n\r\n"
        with connect(port) as sock:
            sock.sendall(fits)
            _, first = closed_within(sock, 0.5)
        assert status(first) == 200, first[:200]
        _healthz_within(port, 1.0)


def _trickle(port: int, *, deadline_s: float) -> tuple[float, bytes]:
    """Send a head one line every 0.2 s, never finishing it; (seconds until the server
    closed, what it answered)."""
    started = time.monotonic()
    answer = b""
    with connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        n = 0
        while time.monotonic() - started < deadline_s:
            try:
                sock.sendall(f"X-{n}: {n}\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started, answer
            n += 1
            closed, sent = closed_within(sock, 0.2)
            answer += sent
            if closed:
                return time.monotonic() - started, answer
    raise AssertionError(f"a head trickled for {deadline_s}s was never closed")


def test_trickled_heads_and_idle_connections_are_closed_at_the_header_timeout(
    start_cp: Callable[..., _Cp],
) -> None:
    cp = start_cp(LLMGW_CONTROLPLANE__HEADER_TIMEOUT_S="1", LLMGW_GATEWAY__HEADER_TIMEOUT_S="1")
    idle = [connect(cp.internal_port) for _ in range(500)]
    try:
        _healthz_within(cp.internal_port, 1.0)
        for port in (cp.internal_port, cp.public_port):
            took, answer = _trickle(port, deadline_s=8)
            assert status(answer) == 408, (port, took, answer[:200])
            assert 0.9 <= took < 4, took
        # Connections that never sent a byte are closed too, without an answer.
        for sock in idle:
            closed, sent = closed_within(sock, 4)
            assert closed and sent == b""
        _healthz_within(cp.internal_port, 1.0)
    finally:
        for sock in idle:
            sock.close()


def _busy_request(port: int, token: str) -> socket.socket:
    """A connection inside a request: its head is in, its body never comes. Expect:
    100-continue makes the server say when the app starts reading the body, so the head has
    been taken in by then."""
    sock = connect(port)
    sock.sendall(
        b"POST /admin/v1/models HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {token}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 100\r\n"
        + b"Expect: 100-continue\r\n\r\n"
    )
    sock.settimeout(10)
    assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
    return sock


def test_at_the_cap_idle_connections_make_room_and_busy_ones_refuse_new_ones(
    start_cp: Callable[..., _Cp],
) -> None:
    cp = start_cp(
        LLMGW_CONTROLPLANE__MAX_CONNECTIONS="20", LLMGW_CONTROLPLANE__HEADER_TIMEOUT_S="60"
    )
    idle = [connect(cp.internal_port) for _ in range(20)]
    try:
        # At the cap, an operator's health check evicts the oldest idle connection.
        _healthz_within(cp.internal_port, 1.0)
        closed, sent = closed_within(idle[0], 2)
        assert closed and sent == b""
    finally:
        for sock in idle:
            sock.close()
    busy: list[socket.socket] = []
    try:
        for _ in range(20):
            busy.append(_busy_request(cp.internal_port, cp.token))
        # Every connection is inside a request: a new one is closed as soon as accepted,
        # before anything is read from it; the requests in flight are left alone.
        with connect(cp.internal_port) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            closed, sent = closed_within(extra, 2)
        assert closed and sent == b""
        assert not any(closed_within(sock, 0.05)[0] for sock in busy)
        busy.pop().close()
        wait_for(
            lambda: httpx.get(f"{cp.internal}/healthz", timeout=1).status_code == 200,
            timeout_s=5,
            what="a health check once a connection was freed",
        )
    finally:
        for sock in busy:
            sock.close()
    text = cp.log.read_text()
    assert "listener_connection_evicted" in text and "listener_connection_refused" in text


def test_the_simulator_bounds_heads_like_every_listener(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, "--header-timeout-s", "1")
    try:
        port = int(sim.base_url.rsplit(":", 1)[1])
        answer = exchange(port, BIG_HEAD)
        assert status(answer) == 431 and b"--max-header-bytes" in answer, answer[:200]
        took, answer = _trickle(port, deadline_s=8)
        assert status(answer) == 408 and took < 4, (took, answer[:200])
        assert httpx.get(f"{sim.base_url}/health", timeout=1).status_code == 200
    finally:
        stop_sim(sim)
