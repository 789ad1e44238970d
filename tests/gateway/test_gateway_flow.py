"""Flow control through the real gateway and real simulator processes: a burst beyond the
replicas' admission ceilings waits in the queue and completes (no replica ever holds more
than its ceiling from this gateway), a full queue and an expired wait shed with 503 and
Retry-After (never 502), and a queued stream sees nothing and leaves the queue at once when
its client goes."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import aiohttp
import httpx
import pytest

from llmgw.config import GatewaySettings
from tests.gateway.gateway_testkit import (
    SIM_KEY,
    Key,
    Served,
    endpoint,
    serve_asgi,
    serve_gateway,
    table,
)
from tests.simengine.sim_process import SimProcess, start_sim, stop_sim
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(90)

A = Key("ka", "tenant-a")
B = Key("kb", "tenant-b")
KEYS = {"sa": A, "sb": B}
CEILING = 3


def _auth(key: Key) -> str:
    secret = next(s for s, k in KEYS.items() if k == key)
    return f"llmgw_{key.key_id}_{secret}"


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimProcess]]:
    tmp = tmp_path_factory.mktemp("sims")
    started = [
        start_sim(tmp, "--served-model-name", "m", env={"SIMENGINE_API_KEY": SIM_KEY})
        for _ in range(2)
    ]
    try:
        yield started
    finally:
        for sim in started:
            stop_sim(sim)


@contextmanager
def _serve(sims: list[SimProcess], **settings: object) -> Iterator[Served]:
    eps = tuple(
        replace(endpoint(f"r{i}", s.base_url), max_in_flight=CEILING) for i, s in enumerate(sims)
    )
    with serve_gateway(table({"m": eps}), KEYS, settings=GatewaySettings(**settings)) as served:
        yield served


async def _chat(
    http: aiohttp.ClientSession, url: str, key: Key, *, max_tokens: int = 8
) -> tuple[int, str, str | None]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "tell me something"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {_auth(key)}"}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        text = await resp.text()
        return resp.status, text, resp.headers.get("Retry-After")


def _peak_in_flight(gw: Served, stop: threading.Event, peaks: dict[str, int]) -> None:
    while not stop.is_set():
        for replica, n in list(gw.gateway.load.in_flight.items()):
            peaks[replica] = max(peaks.get(replica, 0), n)
        stop.wait(0.001)


@pytest.mark.e2e
def test_a_burst_waits_within_the_ceilings_and_completes(sims: list[SimProcess]) -> None:
    with _serve(sims) as gw:
        peaks: dict[str, int] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=_peak_in_flight, args=(gw, stop, peaks))
        watcher.start()

        async def burst() -> list[tuple[int, str, str | None]]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                keys = [A, B] * 30
                return await asyncio.gather(*(_chat(http, gw.url, k) for k in keys))

        try:
            results = asyncio.run(burst())
        finally:
            stop.set()
            watcher.join()
        assert [status for status, _, _ in results] == [200] * 60
        assert all(text.rstrip().endswith("data: [DONE]") for _, text, _ in results)
        assert peaks and max(peaks.values()) <= CEILING
        metrics = gw.metrics_text()
        waited = re.search(
            r'llmgw_gateway_queue_wait_seconds_count\{key="ka",model="m"\} (\S+)', metrics
        )
        assert waited is not None and float(waited.group(1)) >= 20  # all but the first few
        assert "llmgw_gateway_shed_total{" not in metrics


@pytest.mark.e2e
def test_a_full_queue_and_an_expired_wait_shed_with_503(sims: list[SimProcess]) -> None:
    with _serve(sims, queue_max_requests=4, queue_timeout_s=0.5) as gw:

        async def burst() -> list[tuple[int, str, str | None]]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                return await asyncio.gather(
                    *(_chat(http, gw.url, A, max_tokens=400) for _ in range(30))
                )

        results = asyncio.run(burst())
        statuses = sorted(status for status, _, _ in results)
        assert set(statuses) == {200, 503}, statuses
        assert statuses.count(200) >= 2 * CEILING
        for status, text, retry_after in results:
            if status == 503:
                error = json.loads(text)["error"]
                assert error["code"] == "model_overloaded" and retry_after is not None
                assert int(retry_after) >= 1
        metrics = gw.metrics_text()
        assert 'llmgw_gateway_shed_total{model="m",reason="queue_requests"}' in metrics
        assert 'llmgw_gateway_shed_total{model="m",reason="queue_timeout"}' in metrics


@pytest.mark.e2e
def test_a_queued_stream_sees_nothing_and_leaves_when_its_client_goes(
    sims: list[SimProcess],
) -> None:
    with _serve(sims, queue_timeout_s=60) as gw:

        async def scenario() -> None:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                # Fill both replicas' ceilings with long generations.
                busy = [
                    asyncio.create_task(_chat(http, gw.url, A, max_tokens=2000))
                    for _ in range(2 * CEILING)
                ]
                await asyncio.to_thread(
                    wait_for,
                    lambda: sum(gw.gateway.load.in_flight.values()) == 2 * CEILING or None,
                    timeout_s=10,
                    what="both replicas at their ceiling",
                )
                host, port = gw.url.removeprefix("http://").split(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 4, "stream": True})
                writer.write(
                    f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    f"{_auth(B)}\r\nContent-Type: application/json\r\nContent-Length: "
                    f"{len(body)}\r\n\r\n{body}".encode()
                )
                await writer.drain()
                queue = lambda: gw.gateway.flow._queues.get("m")  # noqa: E731
                await asyncio.to_thread(
                    wait_for, lambda: ((q := queue()) is not None and len(q) == 1) or None,
                    timeout_s=5, what="the request queued",
                )  # fmt: skip
                with pytest.raises(TimeoutError):  # no header, no byte while it waits
                    await asyncio.wait_for(reader.read(1), 0.3)
                writer.close()
                await asyncio.to_thread(
                    wait_for, lambda: len(queue() or ()) == 0 or None,
                    timeout_s=2, what="the queue emptied by the disconnect",
                )  # fmt: skip
                for task in busy:
                    task.cancel()
                await asyncio.gather(*busy, return_exceptions=True)

        asyncio.run(scenario())
        assert 'reason="queue_timeout"' not in gw.metrics_text()


class _BusyEngine:
    """An engine that answers every generation 503 before any header, and reports ``load``
    requests running on its /metrics."""

    def __init__(self, load: int) -> None:
        self.load = load

    async def __call__(self, scope: dict[str, object], receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        path = str(scope["path"])
        status, body = 503, b'{"error":"busy"}'
        if path.endswith("/metrics"):
            status, body = 200, f"vllm:num_requests_running {self.load}\n".encode()
        elif path.endswith("/v1/models"):
            status, body = 200, b'{"data":[]}'
        await send({"type": "http.response.start", "status": status, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": body})  # type: ignore[operator]


@pytest.mark.parametrize(("load", "want"), [(6, 503), (0, 502)])
def test_busy_is_not_broken(load: int, want: int) -> None:
    """A replica that refuses while it reports itself loaded has its admission limit halved
    and the request shed with 503 + Retry-After, never ejected; the same refusals at no load
    are faults: 502, and ejection after gateway.eject_after_failures. (Loaded: 6 running of a
    ceiling of 10; once halved to 5, the 6 leave no room and the next requests wait out their
    queue bound: shed too, not sent.)"""
    engine = _BusyEngine(load)
    with serve_asgi(engine) as engine_url:
        ep = replace(endpoint("r0", engine_url), max_in_flight=10)
        settings = GatewaySettings(load_scrape_s=0.05, eject_after_failures=3, queue_timeout_s=0.5)
        with serve_gateway(table({"m": (ep,)}), KEYS, settings=settings) as gw:
            wait_for(lambda: gw.gateway.load.alive("r0") or None, timeout_s=5, what="a scrape")
            answers = []
            for _ in range(3):
                r = httpx.post(
                    f"{gw.url}/v1/completions",
                    json={"model": "m", "prompt": "hi", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {_auth(A)}"},
                    timeout=10,
                )
                answers.append((r.status_code, r.headers.get("Retry-After")))
            metrics = gw.metrics_text()
            if want == 503:
                assert all(s == 503 and ra is not None for s, ra in answers), answers
                assert gw.gateway.flow.windows.limit("r0") == 5
                assert gw.gateway.load.healthy("r0") and gw.gateway.load.failures("r0") == 0
                assert 'reason="replica_busy"' in metrics and 'reason="queue_timeout"' in metrics
                assert "llmgw_gateway_ejections_total{" not in metrics
            else:
                assert [s for s, _ in answers] == [502] * 3
                assert gw.gateway.flow.windows.limit("r0") == 10
                assert not gw.gateway.load.healthy("r0")


def _wakeable(eps: tuple[object, ...]) -> object:
    from llmgw.gateway.routes import ModelRoute, RouteTable

    return RouteTable({"m": ModelRoute("m", "m", None, eps, wakeable=True)}, 1.0)  # type: ignore[arg-type]


@pytest.mark.e2e
def test_a_request_for_a_model_with_no_ready_replica_is_held_then_answered(
    sims: list[SimProcess],
) -> None:
    """Scale from zero at the gateway: held (nothing sent to the client, the demand reporter
    woken once), then routed as soon as the table has a ready replica."""
    with serve_gateway(_wakeable(()), KEYS, settings=GatewaySettings()) as gw:  # type: ignore[arg-type]
        woken: list[int] = []
        gw.gateway.flow.on_hold = lambda: woken.append(1)

        async def scenario() -> list[tuple[int, str, str | None]]:
            async with aiohttp.ClientSession() as http:
                tasks = [asyncio.create_task(_chat(http, gw.url, A)) for _ in range(2)]
                flow = gw.gateway.flow
                await asyncio.to_thread(
                    wait_for,
                    lambda: flow.demand["m"].held == 2,
                    timeout_s=10,
                    what="two requests held",
                )
                assert not any(t.done() for t in tasks)  # held: no status line yet
                ep = replace(endpoint("r0", sims[0].base_url), max_in_flight=CEILING)
                gw.gateway.routes.table = _wakeable((ep,))  # type: ignore[attr-defined]
                return await asyncio.gather(*tasks)

        results = asyncio.run(scenario())
        assert [r[0] for r in results] == [200, 200]
        assert all("[DONE]" in text for _, text, _ in results)
        assert woken == [1]  # the first held request wakes; the second finds it woken
        assert 'llmgw_gateway_wake_seconds_count{model="m"} 1.0' in gw.metrics_text()
        wait_for(lambda: gw.gateway.flow.demand["m"].held == 0, timeout_s=5, what="none held")


def test_a_held_request_past_the_wait_bound_is_shed_with_retry_after() -> None:
    settings = GatewaySettings(queue_timeout_s=0.5)
    with serve_gateway(_wakeable(()), KEYS, settings=settings) as gw:  # type: ignore[arg-type]
        r = httpx.post(
            f"{gw.url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {_auth(A)}"},
            timeout=10,
        )
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "model_overloaded"
