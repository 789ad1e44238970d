"""The agent's listeners under their bounds (llmgw/http/listeners.py): the engine proxy and the
/healthz listener answer a head past the cap 431 before any key is checked, close trickled
heads at the header timeout, make room at the connection cap by evicting idle connections and
refuse new ones only when every connection is inside a request; and `llmgw agent` raises its
descriptor limit, fits its caps to it and runs on uvloop.

The proxies run in the test's loop; every blocking socket call goes through a thread."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from llmgw.nodeagent.metrics import DEFAULT_LIMITS as METRICS_LIMITS
from llmgw.nodeagent.metrics import EndpointServer
from llmgw.nodeagent.proxy import DEFAULT_LIMITS, EngineProxy, ProxyRoute
from tests.nodeagent.agent_harness import AgentProcess
from tests.support.procs import agent_port_base, free_port
from tests.support.raw_http import closed_within, connect, exchange, status
from tests.support.waiting import until, wait_for

pytestmark = pytest.mark.timeout(60)

KEY = "shard-key-0123456789"
BIG_HEAD = (
    b"POST /shards/s1/v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: "
    + b"a" * (1 << 20)
    + b"\r\n\r\n"
)


class _HoldingUpstream:
    """An engine that accepts connections and never answers: a request forwarded to it stays
    inside the proxy until the test ends."""

    def __init__(self) -> None:
        self.accepted = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        async def hold(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.accepted += 1
            self._writers.append(w)

        self._server = await asyncio.start_server(hold, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Close what it holds (the proxy's requests to it fail at once), then stop."""
        for w in self._writers:
            w.close()
        self._writers.clear()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


@pytest.fixture
async def upstream() -> AsyncIterator[_HoldingUpstream]:
    up = _HoldingUpstream()
    await up.start()
    yield up
    await up.stop()


async def _proxy(upstream_port: int, **limits: object) -> EngineProxy:
    p = EngineProxy("127.0.0.1", 0, limits=replace(DEFAULT_LIMITS, **limits))  # type: ignore[arg-type]
    p.set_routes({"s1": ProxyRoute(upstream_port, KEY)})
    await p.start()
    return p


async def _until(condition: Callable[[], Awaitable[bool]], *, timeout_s: float, what: str) -> None:
    await until(condition, timeout_s=timeout_s, what=what)  # a server's state: no event to wait on


async def _get(port: int, path: str) -> int:
    async with httpx.AsyncClient(timeout=1) as http:
        return (await http.get(f"http://127.0.0.1:{port}{path}")).status_code


async def test_a_head_past_the_cap_is_answered_431_before_the_key_is_checked(
    upstream: _HoldingUpstream,
) -> None:
    proxy = await _proxy(upstream.port)
    endpoints = EndpointServer("127.0.0.1", 0, CollectorRegistry(), lambda: {"status": "ok"})
    metrics_port = await endpoints.start()
    try:
        for port, setting in (
            (proxy.port, b"agent.max_header_bytes"),
            (metrics_port, b"agent.max_header_bytes"),
        ):
            answer = await asyncio.to_thread(exchange, port, BIG_HEAD)
            assert status(answer) == 431, answer[:200]
            assert setting in answer
        # Under the cap, a head is judged as before (no key: 401), and both still answer.
        fits = b"GET /shards/s1/health HTTP/1.1\r\nHost: x\r\nX-Ok: " + b"a" * 60_000 + b"\r\n\r\n"
        answer = await asyncio.to_thread(_first_answer, proxy.port, fits)
        assert status(answer) == 401, answer[:200]
        assert await _get(metrics_port, "/healthz") == 200
        assert await _get(proxy.port, "/shards/nope/health") == 404
    finally:
        await proxy.stop()
        await endpoints.stop()
    assert upstream.accepted == 0  # nothing reached the engine


def _first_answer(port: int, head: bytes) -> bytes:
    with connect(port) as sock:
        sock.sendall(head)
        return closed_within(sock, 0.5)[1]


def _trickle(port: int, deadline_s: float) -> bytes:
    answer = b""
    with connect(port) as sock:
        sock.sendall(b"GET /shards/s1/health HTTP/1.1\r\n")
        for n in range(int(deadline_s / 0.2)):
            try:
                sock.sendall(f"X-{n}: {n}\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                return answer
            closed, sent = closed_within(sock, 0.2)
            answer += sent  # the answer and the close may come in two windows
            if closed:
                return answer
    raise AssertionError(f"a head trickled for {deadline_s}s was never closed")


async def test_trickled_heads_are_closed_at_the_header_timeout(
    upstream: _HoldingUpstream,
) -> None:
    proxy = await _proxy(upstream.port, header_timeout_s=0.5)
    idle = await asyncio.to_thread(lambda: [connect(proxy.port) for _ in range(200)])
    try:
        answer = await asyncio.to_thread(_trickle, proxy.port, 5.0)
        assert status(answer) == 408, answer[:200]
        for sock in idle:
            closed, sent = await asyncio.to_thread(closed_within, sock, 3)
            assert closed and sent == b""
        assert await _get(proxy.port, "/shards/nope/health") == 404
    finally:
        for sock in idle:
            sock.close()
        await proxy.stop()


def _in_flight(port: int) -> socket.socket:
    sock = connect(port)
    sock.sendall(
        b"GET /shards/s1/health HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {KEY}\r\n\r\n".encode()
    )
    return sock


async def test_at_the_cap_idle_connections_make_room_and_busy_ones_refuse_new_ones(
    upstream: _HoldingUpstream,
) -> None:
    proxy = await _proxy(upstream.port, max_connections=16, header_timeout_s=60)
    idle = await asyncio.to_thread(lambda: [connect(proxy.port) for _ in range(16)])
    try:
        assert await _get(proxy.port, "/shards/nope/health") == 404  # evicts one idle
        closed, sent = await asyncio.to_thread(closed_within, idle[0], 2)
        assert closed and sent == b""
    finally:
        for sock in idle:
            sock.close()
    busy: list[socket.socket] = []
    try:
        for _ in range(16):
            busy.append(await asyncio.to_thread(_in_flight, proxy.port))

        async def all_forwarded() -> bool:
            return upstream.accepted >= 16

        # Each request is inside the proxy once its engine connection is open.
        await _until(all_forwarded, timeout_s=5, what="16 requests forwarded to the engine")
        with connect(proxy.port) as extra:
            closed, sent = await asyncio.to_thread(closed_within, extra, 2)
        assert closed and sent == b""
        closed_any = await asyncio.to_thread(lambda: any(closed_within(s, 0.05)[0] for s in busy))
        assert not closed_any
        busy.pop().close()

        async def answers() -> bool:
            try:
                return await _get(proxy.port, "/shards/nope/health") == 404
            except httpx.HTTPError:
                return False

        await _until(answers, timeout_s=5, what="an answer once a connection was freed")
    finally:
        for sock in busy:
            sock.close()
        await upstream.stop()  # else the proxy's stop waits out the held requests
        await proxy.stop()


async def test_a_connection_answered_and_lingering_is_evicted_like_any_idle_one(
    upstream: _HoldingUpstream,
) -> None:
    """After its 408 a connection is read from a while (so the answer is not reset away);
    at the cap it is the first to go, and evicting it must not write to it again."""
    proxy = await _proxy(upstream.port, max_connections=16, header_timeout_s=1)
    lingering = await asyncio.to_thread(connect, proxy.port)
    idle: list[socket.socket] = []
    try:
        await asyncio.to_thread(lingering.sendall, b"GET /shards/s1/health HTTP/1.1\r\n")
        closed, answer = await asyncio.to_thread(closed_within, lingering, 5)
        assert closed and status(answer) == 408, answer[:200]  # half-closed: still read
        idle = await asyncio.to_thread(lambda: [connect(proxy.port) for _ in range(15)])
        assert await _get(proxy.port, "/shards/nope/health") == 404  # evicts the lingering
    finally:
        for sock in (lingering, *idle):
            sock.close()
        await proxy.stop()


@pytest.mark.e2e
def test_the_agent_raises_its_descriptor_limit_fits_its_caps_and_runs_on_uvloop(
    tmp_path: Path,
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < 3000:
        pytest.skip(f"the descriptor hard limit ({hard}) is below what the test sets (3000)")
    listen_port = free_port()
    base = agent_port_base()
    agent = AgentProcess(
        state_dir=tmp_path / "state",
        controlplane_url=f"http://127.0.0.1:{free_port()}",  # nothing there: sync retries
        listen_port=listen_port,
        log_path=tmp_path / "agent.log",
        port_range=(base, base + 63),
    )

    def low_limits() -> None:  # soft 512 as Linux's defaults would leave it, hard 3000
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 3000))

    with agent.log_path.open("ab") as log:
        agent.proc = subprocess.Popen(
            agent.argv,
            env=agent.env,
            stdout=log,
            stderr=log,
            start_new_session=True,
            preexec_fn=low_limits,
        )
    try:
        started = wait_for(
            lambda: (agent.assert_alive(), agent.events("agent_started"))[1],
            timeout_s=30,
            what="agent_started",
        )[0]
        assert started["event_loop"] == "uvloop"
        assert started["fd_limit"] == 3000
        limits = Path(f"/proc/{agent.proc.pid}/limits").read_text()
        assert any(
            line.startswith("Max open files") and line.split()[3:5] == ["3000", "3000"]
            for line in limits.splitlines()
        ), limits
        # 3000 descriptors less the reserve for 256 shards cannot carry the default caps.
        assert 16 <= started["proxy_max_connections"] < DEFAULT_LIMITS.max_connections
        lowered = agent.events("connection_caps_lowered_to_fd_limit")
        assert lowered and "LimitNOFILE" in lowered[0]["hint"]
        assert set(lowered[0]["caps"]) == {"proxy", METRICS_LIMITS.listener}
        answer = exchange(
            listen_port, b"GET /healthz HTTP/1.1\r\nX: " + b"a" * (1 << 20) + b"\r\n\r\n"
        )
        assert status(answer) == 431
        assert json.loads(httpx.get(f"http://127.0.0.1:{listen_port}/healthz").text)
    finally:
        agent.terminate()
