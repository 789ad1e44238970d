"""The gateway's request path, served for real against real simulator processes: the official
`openai` client (sync, async, streaming), OpenAI's error shape for every failure, usage asked
for and stripped on streams, settlement on completion and on a client that leaves mid-stream,
the key's cache salt on every request, retries and passive health.

Keys and limits are stand-ins here (gateway_testkit); test_gateway_e2e.py runs the real ones.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from llmgw.config import GatewaySettings
from llmgw.gateway.pool import read_capped
from llmgw.gateway.routes import ModelRoute, RouteTable
from tests.gateway.gateway_testkit import (
    SIM_KEY,
    Key,
    Served,
    Settled,
    endpoint,
    serve_asgi,
    serve_gateway,
    table,
)
from tests.simengine.sim_process import SimProcess, start_sim, stop_sim
from tests.support.procs import free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

GOOD = Key("k1", "good")
ONLY_OTHER = Key("k2", "restricted", allowed_models=frozenset({"other"}))
SALTED = Key("k3", "salted", cache_salt="tenant-salt-1")
LIMITED = Key("k4", "limited")
KEYS = {"s1": GOOD, "s2": ONLY_OTHER, "s3": SALTED, "s4": LIMITED}


def _auth(key: Key, secret: str) -> str:
    return f"llmgw_{key.key_id}_{secret}"


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimProcess]]:
    tmp = tmp_path_factory.mktemp("sims")
    started = [
        start_sim(
            tmp,
            "--served-model-name",
            "m",
            "--time-scale",
            "0.2",
            "--num-blocks",
            "512",
            env={"SIMENGINE_API_KEY": SIM_KEY},
        )
        for _ in range(2)
    ]
    try:
        yield started
    finally:
        for sim in started:
            stop_sim(sim)


@pytest.fixture(scope="module")
def gw(sims: list[SimProcess]) -> Iterator[Served]:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: a connection error
    routes = table(
        {
            "m": tuple(endpoint(f"r{i}", s.base_url) for i, s in enumerate(sims)),
            "down": (),
            "broken": (endpoint("dead", dead),),
            "other": (endpoint("r0", sims[0].base_url),),
        }
    )
    with serve_gateway(routes, KEYS) as served:
        yield served


def _last_released(gw: Served) -> Settled:
    """The newest admission, once released: the answer's last byte can reach the client a
    moment before the gateway settles and releases."""
    return wait_for(
        lambda: gw.limits.admissions[-1] if gw.limits.admissions[-1].released else None,
        timeout_s=5,
        what="the last admission's release",
    )


def _client(gw: Served, key: Key = GOOD, secret: str = "s1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=_auth(key, secret), max_retries=0)


def test_openai_sync_client_chat_and_completions(gw: Served) -> None:
    client = _client(gw)
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=5
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    done = client.completions.create(model="m", prompt="once upon a time", max_tokens=3)
    assert done.choices[0].text and done.usage is not None
    assert [m.id for m in client.models.list()] == ["broken", "down", "m", "other"]
    record = _last_released(gw)
    assert record.settled == [
        (
            done.usage.prompt_tokens,
            3,
            done.usage.prompt_tokens_details.cached_tokens
            if done.usage.prompt_tokens_details
            else 0,
        )
    ]
    assert record.released and record.reserve >= 3


def test_a_request_without_max_tokens_reserves_the_models_context_length(gw: Served) -> None:
    """What the engine may generate is reserved: the replicas' max_model_len (the
    simulator's default, 32768, as their /v1/models says) less the prompt."""
    wait_for(
        lambda: gw.gateway.load.context_limit(["r0", "r1"]) == 32768,
        timeout_s=10,
        what="the gateway to learn the replicas' context length",
    )
    prompt = "a question " * 40
    stream = _client(gw).chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], stream=True
    )
    next(iter(stream))  # admitted and answering; the rest is not needed
    stream.close()
    record = _last_released(gw)
    assert record.reserve == 32768  # the prompt's estimate plus the rest of the context
    _client(gw).chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=4
    )
    assert _last_released(gw).reserve < 200  # asked for 4: the prompt's estimate plus 4


def test_openai_async_client_and_streaming(gw: Served) -> None:
    async def run() -> tuple[list[str], int]:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=_auth(GOOD, "s1"))
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "stream please"}],
            max_tokens=8,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        many = await asyncio.gather(
            *(client.completions.create(model="m", prompt=f"p{i}", max_tokens=2) for i in range(8))
        )
        await client.close()
        return pieces, len(many)

    pieces, n = asyncio.run(run())
    assert len([p for p in pieces if p]) == 8 and n == 8


def test_stream_usage_is_asked_for_and_stripped_unless_the_client_asked(gw: Served) -> None:
    client = _client(gw)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True
        )
    )
    assert all(c.usage is None for c in chunks)
    # ... yet the gateway settled from the engine's usage it asked for.
    assert _last_released(gw).settled[0][1] == 4
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_a_client_leaving_mid_stream_is_settled_for_what_was_streamed(gw: Served) -> None:
    before = len(gw.limits.admissions)
    # Long enough that the engine is still generating when the client's leaving is noticed,
    # even on two busy cores (400 tokens were sometimes all out before that).
    body = {"model": "m", "prompt": "tell a long story", "max_tokens": 4000, "stream": True}
    headers = {"Authorization": f"Bearer {_auth(GOOD, 's1')}"}
    with (
        httpx.Client(timeout=10) as http,
        http.stream("POST", f"{gw.url}/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
            if got >= 3:
                break
    record = wait_for(
        lambda: next((a for a in gw.limits.admissions[before:] if a.released and a.settled), None),
        timeout_s=10,
        what="the abandoned stream's settlement",
    )
    prompt, completion, _ = record.settled[0]
    assert 3 <= completion < 4000 and prompt > 0


def test_cache_salt_of_the_key_reaches_the_engine(sims: list[SimProcess]) -> None:
    # One replica, one prompt: the salted key's second request hits its own blocks, the
    # unsalted key's request for the same prompt hits nothing (the salt is hashed into block 0).
    prompt = "salted prefix " * 40
    with serve_gateway(table({"m": (endpoint("r0", sims[0].base_url),)}), KEYS) as gw:
        salted = _client(gw, SALTED, "s3")
        plain = _client(gw, GOOD, "s1")

        def cached(client: openai.OpenAI) -> int:
            r = client.completions.create(model="m", prompt=prompt, max_tokens=1)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            return r.usage.prompt_tokens_details.cached_tokens or 0

        cached(salted)
        assert cached(salted) > 0
        assert cached(plain) == 0
        assert cached(plain) > 0  # the control: unsalted requests do share with each other


def _error(r: httpx.Response) -> dict[str, object]:
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


@pytest.mark.parametrize(
    ("auth", "model", "status", "type_", "code"),
    [
        (None, "m", 401, "authentication_error", "invalid_api_key"),
        ("Bearer llmgw_k1_wrong", "m", 401, "authentication_error", "invalid_api_key"),
        ("Bearer llmgw_k1_s1", "nope", 404, "invalid_request_error", "model_not_found"),
        ("Bearer llmgw_k2_s2", "m", 404, "invalid_request_error", "model_not_found"),
        ("Bearer llmgw_k1_s1", "down", 503, "api_error", "no_ready_replica"),
        ("Bearer llmgw_k4_s4", "m", 429, "rate_limit_error", "rate_limit_exceeded"),
        ("Bearer llmgw_k1_s1", "broken", 502, "api_error", "upstream_error"),
    ],
)
def test_each_failure_in_openai_shape(
    gw: Served, auth: str | None, model: str, status: int, type_: str, code: str
) -> None:
    headers = {"Authorization": auth} if auth else {}
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers=headers,
        timeout=10,
    )
    assert r.status_code == status, r.text
    err = _error(r)
    assert (err["type"], err["code"]) == (type_, code)
    if status == 429:
        assert r.headers["retry-after"] == "8"
    if status == 503:
        assert r.headers["retry-after"] == "1"
    assert "s1" not in str(err["message"])  # never echoes the key


class _DeclaredLate:
    """A route source whose table lacks "m" until a read after the request (a model or
    adapter declared a moment before it was asked for, its NOTIFY not read yet)."""

    def __init__(self, before: RouteTable, after: RouteTable) -> None:
        self.table, self._after, self.catch_ups = before, after, 0

    async def catch_up(self) -> None:
        self.catch_ups += 1
        self.table = self._after


def test_a_model_declared_a_moment_ago_is_found_by_a_fresh_read(sims: list[SimProcess]) -> None:
    """A name missing from the table gets one fresh read before its 404; a name the key may
    not use gets none (it is a 404 whatever the table says)."""
    ep = (endpoint("r0", sims[0].base_url),)
    source = _DeclaredLate(table({"other": ep}), table({"other": ep, "m": ep}))
    with serve_gateway(source, KEYS) as served:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for key, secret in ((ONLY_OTHER, "s2"), (GOOD, "s1")):
            r = httpx.post(
                f"{served.url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {_auth(key, secret)}"},
                timeout=30,
            )
            if key is GOOD:
                assert r.status_code == 200, r.text
                assert source.catch_ups == 1
            else:
                assert r.status_code == 404 and source.catch_ups == 0, r.text


def test_openai_client_raises_its_own_exception_classes(gw: Served) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(gw, GOOD, "bad").models.list()
    with pytest.raises(openai.NotFoundError):
        _client(gw).completions.create(model="nope", prompt="x")
    with pytest.raises(openai.RateLimitError):
        _client(gw, LIMITED, "s4").completions.create(model="m", prompt="x")
    with pytest.raises(openai.InternalServerError):
        _client(gw).completions.create(model="down", prompt="x")


def test_body_rules(gw: Served) -> None:
    auth = {"Authorization": f"Bearer {_auth(GOOD, 's1')}"}
    r = httpx.post(f"{gw.url}/v1/completions", content=b"{nope", headers=auth)
    assert r.status_code == 400 and _error(r)["code"] == "invalid_json"
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "x"}, headers=auth)
    assert r.status_code == 400 and _error(r)["param"] == "model"
    big = b'{"model":"m","prompt":"' + b"x" * (9 * 1024 * 1024) + b'"}'
    r = httpx.post(f"{gw.url}/v1/completions", content=big, headers=auth, timeout=30)
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
    # The key is checked before the body is read: a big body without a key is a 401.
    r = httpx.post(f"{gw.url}/v1/completions", content=big, timeout=30)
    assert r.status_code == 401
    r = httpx.get(f"{gw.url}/v1/completions", headers=auth)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.get(f"{gw.url}/admin/v1/models", headers=auth)
    assert r.status_code == 404 and _error(r)["code"] == "unknown_url"
    # An engine's own 400 passes through as it is (already OpenAI's shape).
    r = httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": "m", "prompt": "x", "temperature": -3},
        headers=auth,
    )
    assert r.status_code == 400 and _error(r)["param"] == "temperature"


async def _proxy_cannot_reach_its_engine(scope: Any, receive: Any, send: Any) -> None:
    """What the agent's proxy answers when its engine refuses connections."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = json.dumps(
        {
            "error": {
                "message": "x",
                "type": "server_error",
                "param": None,
                "code": "upstream-unavailable",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 502,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _engine_not_found(scope: Any, receive: Any, send: Any) -> None:
    """An engine's own 404 for a model it does not serve (vLLM's shape), not the proxy's."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = json.dumps(
        {"error": {"message": "The model `m` does not exist.", "type": "NotFoundError",
                   "param": "model", "code": 404}}
    ).encode()  # fmt: skip
    await send(
        {
            "type": "http.response.start",
            "status": 404,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def test_an_engines_own_404_reaches_the_client_with_its_body() -> None:
    # The gateway reads a 404's body to tell the agent's proxy ("not-found": retried) from
    # the engine; the engine's answer must still reach the client whole, not emptied.
    with (
        serve_asgi(_engine_not_found) as engine,
        serve_gateway(table({"m": (endpoint("a", engine),)}), KEYS) as gw,
    ):
        for stream in (False, True):
            r = httpx.post(
                f"{gw.url}/v1/completions",
                json={"model": "m", "prompt": "x", "max_tokens": 1, "stream": stream},
                headers={"Authorization": f"Bearer {_auth(GOOD, 's1')}"},
                timeout=30,
            )
            assert r.status_code == 404, r.text
            assert r.json()["error"]["message"] == "The model `m` does not exist.", r.text


def test_a_runtime_adapter_a_replica_no_longer_holds_goes_to_another_holder_or_waits(
    sims: list[SimProcess],
) -> None:
    # The route table says both replicas hold adapter "m" (loaded at runtime), but one
    # engine has unloaded it since: its 404 is not the client's answer. With another holder the
    # request goes there; with none, a 503 the client retries, and no replica is ejected.
    settings = GatewaySettings(routing_policy="round_robin", eject_after_failures=1)
    with serve_asgi(_engine_not_found) as gone:
        both = (endpoint("a-gone", gone), endpoint("b-live", sims[0].base_url))
        routes = RouteTable({"m": ModelRoute("m", "m", ("m", "/a"), both, runtime=True)}, 1.0)
        with serve_gateway(routes, KEYS, settings=settings) as gw:
            client = _client(gw)
            for _ in range(4):
                assert client.completions.create(model="m", prompt="x", max_tokens=1).choices
            text = gw.metrics_text()
        assert "llmgw_gateway_ejections_total{" not in text
        alone = RouteTable({"m": ModelRoute("m", "m", ("m", "/a"), both[:1], runtime=True)}, 1.0)
        with serve_gateway(alone, KEYS, settings=settings) as gw:
            r = httpx.post(
                f"{gw.url}/v1/completions",
                json={"model": "m", "prompt": "x", "max_tokens": 1},
                headers={"Authorization": f"Bearer {_auth(GOOD, 's1')}"},
                timeout=30,
            )
            assert r.status_code == 503 and _error(r)["code"] == "adapter_loading", r.text
            assert r.headers["retry-after"]


@pytest.mark.parametrize("bad_kind", ["connection refused", "proxy 502"])
def test_an_unreachable_replica_is_retried_once_elsewhere_then_ejected(
    sims: list[SimProcess], bad_kind: str
) -> None:
    settings = GatewaySettings(routing_policy="round_robin", eject_after_failures=2)
    with serve_asgi(_proxy_cannot_reach_its_engine) as proxy:
        url = f"http://127.0.0.1:{free_port()}" if bad_kind == "connection refused" else proxy
        routes = table({"m": (endpoint("a-bad", url), endpoint("b-live", sims[0].base_url))})
        with serve_gateway(routes, KEYS, settings=settings) as gw:
            client = _client(gw)
            for _ in range(6):
                assert client.completions.create(model="m", prompt="x", max_tokens=1).choices
            text = gw.metrics_text()
    # Round-robin reached the bad replica twice before it was ejected; both were retried.
    assert 'llmgw_gateway_retries_total{model="m"} 2.0' in text
    assert 'llmgw_gateway_ejections_total{replica="a-bad"} 1.0' in text
    assert (
        'llmgw_gateway_upstream_errors_total{kind="connect",model="m",replica="a-bad"} 2.0' in text
    )


def test_least_loaded_spreads_and_metrics_count_requests(gw: Served) -> None:
    client = _client(gw)
    for i in range(4):
        client.completions.create(model="m", prompt=f"spread {i}", max_tokens=1)
    # A stream's first token is what TTFT measures: one of this test's own, whichever tests of
    # the module ran on this worker before it.
    for _ in client.completions.create(model="m", prompt="spread s", max_tokens=1, stream=True):
        pass
    text = gw.metrics_text()
    for replica in ("r0", "r1"):
        assert f'llmgw_gateway_requests_total{{model="m",replica="{replica}",status="200"}}' in text
    assert "llmgw_prefix_decisions_total" in text
    assert text.count("llmgw_gateway_ttft_seconds_count") > 0


async def _dies_mid_stream(scope: Any, receive: Any, send: Any) -> None:
    """An engine that streams two chunks, then its connection drops."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for text in ("a", "b"):
        chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
        body = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": True})
        # Time for the chunk to reach the gateway: aiohttp drops what it buffered when the
        # connection breaks in the same read.
        await asyncio.sleep(0.1)
    raise RuntimeError("the engine died")  # uvicorn cuts the connection: no terminating chunk


def test_a_failure_mid_stream_ends_with_an_openai_error_event() -> None:
    with (
        serve_asgi(_dies_mid_stream) as upstream,
        serve_gateway(table({"m": (endpoint("r0", upstream),)}), KEYS) as gw,
    ):
        body = {"model": "m", "prompt": "x", "max_tokens": 10, "stream": True}
        headers = {"Authorization": f"Bearer {_auth(GOOD, 's1')}"}
        with httpx.stream(
            "POST", f"{gw.url}/v1/completions", json=body, headers=headers, timeout=10
        ) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) == 3
        last = json.loads(events[-1][6:])
        assert last["error"]["code"] == "upstream_error" and last["error"]["type"] == "api_error"
        # Settled for the two chunks that reached the client.
        record = _last_released(gw)
        assert record.settled[0][1] == 2
        text = gw.metrics_text()
        assert 'kind="midstream",model="m",replica="r0"} 1.0' in text


def test_an_adapter_name_routes_to_its_base_model_replicas(tmp_path: Path) -> None:
    sim = start_sim(
        tmp_path,
        *("--served-model-name", "base", "--lora-modules", "sql=/adapters/sql"),
        env={"SIMENGINE_API_KEY": SIM_KEY},
    )
    try:
        ep = endpoint("r0", sim.base_url)
        routes = RouteTable(
            {
                "base": ModelRoute("base", "base", None, (ep,)),
                "sql": ModelRoute("sql", "base", ("sql", "/adapters/sql"), (ep,)),
            },
            1.0,
        )
        with serve_gateway(routes, KEYS) as gw:
            client = _client(gw)
            listed = {m.id: m for m in client.models.list()}
            assert set(listed) == {"base", "sql"}
            assert listed["sql"].model_extra is not None
            assert listed["sql"].model_extra["parent"] == "base"
            r = client.completions.create(model="sql", prompt="select", max_tokens=2)
            assert r.model == "sql" and r.choices[0].text
    finally:
        stop_sim(sim)


def test_a_client_leaving_a_long_unstreamed_request_aborts_it_on_the_engine(
    tmp_path: Path,
) -> None:
    slow = start_sim(
        tmp_path,
        *("--served-model-name", "m", "--time-scale", "5"),
        env={"SIMENGINE_API_KEY": SIM_KEY},
    )

    def engine_running() -> float:
        text = httpx.get(f"{slow.base_url}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )

    try:
        with serve_gateway(table({"m": (endpoint("r0", slow.base_url),)}), KEYS) as gw:
            body = {"model": "m", "prompt": "a very long answer", "max_tokens": 2000}
            headers = {"Authorization": f"Bearer {_auth(GOOD, 's1')}"}
            with pytest.raises(httpx.ReadTimeout):  # seconds of generation; gone after 1 s
                httpx.post(f"{gw.url}/v1/completions", json=body, headers=headers, timeout=1.0)
            wait_for(lambda: engine_running() == 0, timeout_s=3, what="the engine's abort")
            wait_for(lambda: not gw.gateway.load.in_flight, timeout_s=3, what="in-flight at 0")
            record = gw.limits.admissions[-1]
            assert record.released and record.settled == []  # nothing delivered, nothing billed
    finally:
        stop_sim(slow)


class _Firehose:
    """An engine streaming as fast as its client takes: ``total_mib`` MiB of 64 KiB chunks,
    counting what it managed to hand to its server (``sent``)."""

    CHUNK = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x" * 65500}]}).encode()

    def __init__(self, total_mib: int) -> None:
        self.chunks = total_mib * 16
        self.sent = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] != "/v1/completions":  # the gateway's /metrics and /v1/models scrapes
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(self.chunks):
            # uvicorn waits here while its transport is over the high-water mark.
            await send(
                {"type": "http.response.body", "body": self.CHUNK + b"\n\n", "more_body": True}
            )
            self.sent += len(self.CHUNK) + 2
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def test_a_client_that_stops_reading_holds_the_engine_back_not_the_gateways_memory() -> None:
    """Backpressure end to end: the gateway reads the next chunk from the engine only after
    the client took the previous one, so a client that reads nothing stops the engine's
    stream after what the sockets' buffers and the two bounded relay buffers (aiohttp's
    64 KiB read buffer, uvicorn's write high-water mark) hold, not after 128 MiB."""
    firehose = _Firehose(total_mib=128)
    with (
        serve_asgi(firehose) as upstream,
        serve_gateway(table({"m": (endpoint("r0", upstream),)}), KEYS) as gw,
    ):
        body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 10, "stream": True})
        port = int(gw.url.rsplit(":", 1)[1])
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        client.connect(("127.0.0.1", port))
        try:
            client.sendall(
                (
                    f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                    f"Authorization: Bearer {_auth(GOOD, 's1')}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
                ).encode()
            )
            # The engine has started, then stalls: its count stops growing for a second.
            last = [-1, time.monotonic()]

            def stalled() -> bool:
                if firehose.sent != last[0]:
                    last[:] = [firehose.sent, time.monotonic()]
                    return False
                return firehose.sent > 0 and time.monotonic() - last[1] > 1.0

            wait_for(stalled, timeout_s=30, what="the engine's stream to stall")
            assert firehose.sent < 64 * 2**20, f"{firehose.sent / 2**20:.0f} MiB left the engine"
            # Reading resumes the stream: everything arrives, in order, nothing lost.
            client.settimeout(30)
            received = 0
            tail = b""
            while not tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                data = client.recv(1 << 20)
                assert data, "the gateway closed the stream early"
                received += len(data)
                tail = (tail + data)[-64:]
            assert firehose.sent == firehose.chunks * (len(_Firehose.CHUNK) + 2)
            assert received > firehose.sent  # plus headers and chunked framing
        finally:
            client.close()


async def _sized(scope: Any, receive: Any, send: Any) -> None:
    """``/<n>`` answers n bytes, chunked (no length declared) unless the query says ``declared``."""
    if scope["type"] != "http":
        return
    n = int(scope["path"].strip("/"))
    headers = [(b"content-length", str(n).encode())] if scope["query_string"] else []
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for _ in range(n // 65536):
        await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
    await send({"type": "http.response.body", "body": b"x" * (n % 65536)})


def test_bodies_the_gateway_reads_from_an_engine_are_capped() -> None:
    """What the gateway reads for itself (metrics, models, the proxy's errors) stops at its
    cap, declared or streamed; what fits is read whole."""

    async def read(url: str) -> bytes | None:
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return await read_capped(resp, 1_000_000)

    with serve_asgi(_sized) as base:
        assert asyncio.run(read(f"{base}/1000000")) == b"x" * 1_000_000
        assert asyncio.run(read(f"{base}/1000001")) is None
        assert asyncio.run(read(f"{base}/1000001?declared")) is None
        assert asyncio.run(read(f"{base}/200000000")) is None  # stops reading, not 200 MB later


def _decisions(gw: Served, outcome: str) -> float:
    line = f'llmgw_prefix_decisions_total{{method="approximate",model="m",outcome="{outcome}"}}'
    for row in gw.metrics_text().splitlines():
        if row.startswith(line):
            return float(row.rsplit(None, 1)[1])
    return 0.0


def test_a_restarted_engine_loses_the_trees_claims_and_a_reconnected_one_keeps_them(
    sims: list[SimProcess],
) -> None:
    # The tree remembers what it sent where; an engine restarted since (a new process in the
    # route table: empty KV cache) holds none of it, an unchanged one still does.
    def routes(incarnation: str) -> RouteTable:
        eps = tuple(
            replace(endpoint(f"r{i}", s.base_url), incarnation=f"{incarnation}-{i}")
            for i, s in enumerate(sims)
        )
        return table({"m": eps})

    # Homes off: a short prompt's home may be another replica than its holder.
    settings = GatewaySettings(routing_policy="approximate", affinity_tokens=0)
    prompt = "a long shared instruction about the sea and its tides. " * 8  # 7 chunks
    with serve_gateway(routes("boot1"), KEYS, settings=settings) as gw:
        client = _client(gw)

        def ask() -> None:
            client.completions.create(model="m", prompt=prompt, max_tokens=1)

        ask()
        ask()
        assert (_decisions(gw, "miss"), _decisions(gw, "hit")) == (1.0, 1.0)
        # The table re-read, the same processes (an agent reconnected, a replica drained and
        # back): claims stand.
        gw.gateway.routes.table = routes("boot1")  # type: ignore[misc]
        ask()
        assert (_decisions(gw, "miss"), _decisions(gw, "hit")) == (1.0, 2.0)
        # New processes: the prompt is nobody's; what is sent after the restart counts.
        gw.gateway.routes.table = routes("boot2")  # type: ignore[misc]
        ask()
        assert (_decisions(gw, "miss"), _decisions(gw, "hit")) == (2.0, 2.0)
        ask()
        assert (_decisions(gw, "miss"), _decisions(gw, "hit")) == (2.0, 3.0)
