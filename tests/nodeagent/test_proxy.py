"""EngineProxy against real `llmgw simengine` processes on loopback.

One engine runs WITHOUT an API key: had the proxy let an unauthenticated request through, that
engine would have served it and counted it, so "401 and the engine's request counter did not
move" proves the request never reached it. A second engine requires its key, so a 200 through
the proxy proves the Authorization header was forwarded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.nodeagent.proxy import EngineProxy, ProxyRoute, split_path
from tests.simengine.sim_process import SimProcess, start_sim, stop_sim

pytestmark = pytest.mark.e2e

KEY = "shard-key-0123456789"
OPEN, KEYED = "shard-open", "shard-keyed"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("/shards/s1/v1/completions", ("s1", "/v1/completions")),
        ("/shards/s1/v1/chat/completions?x=1", ("s1", "/v1/chat/completions")),
        ("/shards/s1/tokenize", ("s1", "/tokenize")),
        ("/shards/s1/health", ("s1", "/health")),
        ("/shards/s1/metrics", ("s1", "/metrics")),
        ("/shards/s1/v1/", None),
        ("/shards/s1/v1", None),
        ("/shards/s1/debug/kv_blocks", None),
        ("/shards/s1/pause", None),
        ("/shards/s1/v1/../pause", None),
        ("/shards/s1/v1/%2e%2e/pause", None),
        ("/shards/s1/v1/%2E%2E%2Fpause", None),
        ("/shards/s1/v1/x%5c..%5cpause", None),
        ("/shards/s1/v1//completions", None),
        ("/shards/../v1/models", None),
        ("/shards/s1", None),
        ("/shards//v1/models", None),
        ("/v1/models", None),
        ("/shards/s%31/v1/models", None),
    ],
)
def test_only_allowed_paths_of_a_well_formed_shard_pass(
    raw: str, expected: tuple[str, str] | None
) -> None:
    assert split_path(raw) == expected


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimProcess, SimProcess]]:
    tmp = tmp_path_factory.mktemp("proxy")
    # time-scale 20: ~40 ms per decode step, so streamed tokens are spread out in time.
    slow = ("--time-scale", "20", "--log-level", "warning")
    open_sim = start_sim(tmp, *slow)
    keyed_sim = start_sim(tmp, *slow, env={"SIMENGINE_API_KEY": KEY})
    yield open_sim, keyed_sim
    stop_sim(open_sim)
    stop_sim(keyed_sim)


def _port(sim: SimProcess) -> int:
    return int(sim.base_url.rsplit(":", 1)[1])


@pytest.fixture
async def proxy(engines: tuple[SimProcess, SimProcess]) -> AsyncIterator[str]:
    open_sim, keyed_sim = engines
    p = EngineProxy("127.0.0.1", 0, max_body_bytes=4096)
    p.set_routes({OPEN: ProxyRoute(_port(open_sim), KEY), KEYED: ProxyRoute(_port(keyed_sim), KEY)})
    port = await p.start()
    yield f"http://127.0.0.1:{port}"
    await p.stop()


def _successes(sim: SimProcess) -> float:
    text = httpx.get(f"{sim.base_url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def _completion(prompt: str = "hello there", **kw: object) -> dict[str, object]:
    return {"model": "sim-model", "prompt": prompt, "max_tokens": 3, **kw}


async def test_wrong_or_missing_key_is_refused_before_the_engine_sees_it(
    proxy: str, engines: tuple[SimProcess, SimProcess]
) -> None:
    open_sim, _ = engines
    before = await asyncio.to_thread(_successes, open_sim)
    async with httpx.AsyncClient(base_url=proxy, timeout=10) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = await http.post(
                f"/shards/{OPEN}/v1/completions", json=_completion(), headers=headers
            )
            assert r.status_code == 401
            error = r.json()["error"]
            assert error["code"] == "unauthorized" and KEY not in r.text
            assert set(error) == {"message", "type", "param", "code"}  # OpenAI's shape
        ok = await http.post(
            f"/shards/{OPEN}/v1/completions",
            json=_completion(),
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert ok.status_code == 200, ok.text
    # The open engine would have served the refused requests: only the authorized one arrived.
    assert await asyncio.to_thread(_successes, open_sim) == before + 1


async def test_the_metrics_token_opens_metrics_and_nothing_else(
    engines: tuple[SimProcess, SimProcess],
) -> None:
    open_sim, _ = engines
    token = "prometheus-scrape-token-0123"
    p = EngineProxy("127.0.0.1", 0, metrics_token=token)
    p.set_routes({OPEN: ProxyRoute(_port(open_sim), KEY)})
    base = f"http://127.0.0.1:{await p.start()}"
    try:
        scrape = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            r = await http.get(f"/shards/{OPEN}/metrics", headers=scrape)
            assert r.status_code == 200 and "vllm:" in r.text
            before = await asyncio.to_thread(_successes, open_sim)
            for method, path in (("POST", "/v1/completions"), ("POST", "/tokenize")):
                r = await http.request(
                    method, f"/shards/{OPEN}{path}", json=_completion(), headers=scrape
                )
                assert r.status_code == 401, (path, r.text)
            assert await asyncio.to_thread(_successes, open_sim) == before
    finally:
        await p.stop()


async def test_the_key_is_forwarded_to_an_engine_that_checks_it(proxy: str) -> None:
    async with httpx.AsyncClient(base_url=proxy, timeout=10) as http:
        auth = {"Authorization": f"Bearer {KEY}"}
        r = await http.post(f"/shards/{KEYED}/v1/completions", json=_completion(), headers=auth)
        assert r.status_code == 200, r.text
        assert (await http.get(f"/shards/{KEYED}/health", headers=auth)).status_code == 200
        metrics = await http.get(f"/shards/{KEYED}/metrics", headers=auth)
        assert "vllm:num_requests_running" in metrics.text
        tokens = await http.post(f"/shards/{KEYED}/tokenize", json={"prompt": "a b"}, headers=auth)
        assert tokens.status_code == 200 and tokens.json()["count"] >= 2
        assert (await http.get(f"/shards/{KEYED}/v1/models", headers=auth)).json()["data"]


async def test_streamed_tokens_arrive_one_by_one(proxy: str) -> None:
    arrivals: list[float] = []
    async with (
        httpx.AsyncClient(base_url=proxy, timeout=30) as http,
        http.stream(
            "POST",
            f"/shards/{OPEN}/v1/completions",
            json=_completion(max_tokens=16, stream=True),
            headers={"Authorization": f"Bearer {KEY}"},
        ) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) >= 17  # 16 tokens and [DONE]
    # Unbuffered: events arrive spread over the generation, not in one burst at its end.
    spread = arrivals[-1] - arrivals[0]
    assert spread > 0.3, f"all events arrived within {spread:.3f}s"
    first_half = sum(1 for t in arrivals if t < arrivals[0] + spread / 2)
    assert 3 <= first_half <= len(arrivals) - 3


async def _raw_status(proxy: str, request_line: str) -> int:
    host, port = proxy.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"{request_line}\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Connection: close\r\n\r\n".encode()
    )
    await writer.drain()
    status = await reader.readline()
    writer.close()
    return int(status.split()[1])


async def test_other_paths_and_traversal_are_404(proxy: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=proxy, timeout=10) as http:
        for path in (
            f"/shards/{OPEN}/debug/kv_blocks",
            f"/shards/{OPEN}/pause",
            "/shards/x/health",
        ):
            r = await http.post(path, headers=auth)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not-found"
    # Raw request lines: clients normalise dot segments, an attacker does not.
    for target in (
        f"/shards/{OPEN}/v1/../pause",
        f"/shards/{OPEN}/v1/%2e%2e/debug/kv_blocks",
        f"/shards/{OPEN}/v1/..%2fpause",
    ):
        assert await _raw_status(proxy, f"POST {target} HTTP/1.1") == 404


async def test_bodies_over_the_cap_are_413(proxy: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=proxy, timeout=10) as http:
        big = _completion(prompt="x" * 5000)
        r = await http.post(f"/shards/{OPEN}/v1/completions", json=big, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body-too-large"

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b"x" * 1000

        r = await http.post(f"/shards/{OPEN}/v1/completions", content=chunked(), headers=auth)
        assert r.status_code == 413
        # The wrong key is refused before the body is looked at, whatever its size.
        r = await http.post(f"/shards/{OPEN}/v1/completions", json=big)
        assert r.status_code == 401


async def test_an_engine_that_is_down_is_502(tmp_path: Path) -> None:
    p = EngineProxy("127.0.0.1", 0)
    from tests.support.procs import free_port

    p.set_routes({"gone": ProxyRoute(free_port(), KEY)})
    port = await p.start()
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(
                f"http://127.0.0.1:{port}/shards/gone/health",
                headers={"Authorization": f"Bearer {KEY}"},
            )
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream-unavailable"
    finally:
        await p.stop()


async def test_a_client_that_leaves_mid_stream_stops_the_generation(
    proxy: str, engines: tuple[SimProcess, SimProcess]
) -> None:
    open_sim, _ = engines
    async with httpx.AsyncClient(base_url=proxy, timeout=30) as http:
        async with http.stream(
            "POST",
            f"/shards/{OPEN}/v1/completions",
            json=_completion(max_tokens=400, stream=True),  # ~16 s if nobody stopped it
            headers={"Authorization": f"Bearer {KEY}"},
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # leave after the first event
        # The proxy must drop its upstream connection, so the engine aborts the request.
        deadline = time.monotonic() + 5
        while True:
            counts = (await http.get(f"{open_sim.base_url}/debug/kv_blocks")).json()["counts"]
            if counts["running"] == 0 and counts["waiting"] == 0:
                break
            assert time.monotonic() < deadline, f"engine still generating: {counts}"
            await asyncio.sleep(0.05)
        # And the proxy still serves.
        ok = await http.get(f"/shards/{OPEN}/health", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200


class _OneAnswerEngine:
    """An engine that answers its first request on a keep-alive connection and drops the
    connection, unanswered, on the next one: what a pooled connection to an engine killed
    between two requests looks like to the proxy. With ``dies``, it stops listening before it
    drops the connection (killed); without, it keeps listening (broke mid-request)."""

    def __init__(self, *, dies: bool) -> None:
        self.dies = dies
        self.server: asyncio.Server | None = None
        self.requests = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readuntil(b"\r\n\r\n"):
            self.requests += 1
            if self.requests == 1:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                continue
            if self.dies and self.server is not None:
                self.server.close()
            writer.transport.abort()  # no answer: a reset, as a killed process leaves
            return

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.mark.parametrize(
    ("dies", "code"), [(True, "upstream-unavailable"), (False, "upstream-failed")]
)
async def test_a_pooled_connection_lost_before_an_answer_is_unreached_only_if_the_engine_is_gone(
    dies: bool, code: str
) -> None:
    # The gateway retries only "upstream-unavailable" elsewhere: an engine that still listens
    # may have started the work, a dead one runs nothing.
    engine = _OneAnswerEngine(dies=dies)
    p = EngineProxy("127.0.0.1", 0)
    p.set_routes({"s": ProxyRoute(await engine.start(), KEY)})
    port = await p.start()
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            first = await http.get("/shards/s/health", headers=auth)
            assert first.status_code == 200
            second = await http.post("/shards/s/v1/completions", json={"prompt": "x"}, headers=auth)
        assert engine.requests == 2, "the second request must go out on the pooled connection"
        assert second.status_code == 502 and second.json()["error"]["code"] == code
    finally:
        await p.stop()
        engine.close()
