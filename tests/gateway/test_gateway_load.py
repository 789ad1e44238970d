"""Replica load and work as the router reads them: a request's prefill counts as work on its
replica until its first token (not the role-only chunk an engine may send first), other
gateways' requests come from a real scrape of the engine's /metrics, and the gateway's own are
not counted twice."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from typing import Any

import aiohttp
import httpx
import pytest

from llmgw.engines import ANY_ENGINE_LOAD_METRICS, engine_load_metrics
from llmgw.gateway.load import LoadTracker, parse_engine_load
from llmgw.gateway.routing.router import HashParams
from llmgw.gateway.tokenize import Tokenizer
from llmgw.gateway.wire import prompt_of
from tests.gateway.gateway_testkit import SIM_KEY, Key, endpoint, serve_asgi, serve_gateway, table
from tests.support.procs import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

HASHED = HashParams(seed="0", block_size=16, extra_key_format="tagged")


def _tracker() -> LoadTracker:
    return LoadTracker(eject_after=3, eject_for_s=10.0, clock=time.monotonic)


def test_a_requests_prefill_is_work_until_its_first_token() -> None:
    t = _tracker()
    t.started("r", 1800.0)
    t.started("r", 40.0)
    assert (t.load("r"), t.work("r")) == (2, 1840.0)
    t.prefilled("r", 1800.0)  # its first token came
    assert (t.load("r"), t.work("r")) == (2, 40.0)
    t.finished("r", 0.0)
    t.finished("r", 40.0)  # ended before its first token: what was left goes too
    assert (t.load("r"), t.work("r")) == (0, 0.0)
    assert not t.in_flight and not t.prefill  # nothing left behind per replica


def test_engine_load_reads_vllms_and_llama_servers_names_and_nothing_else() -> None:
    vllm = b"""# HELP vllm:num_requests_running x
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:num_requests_running_total 99
"""
    # As llama-server 11434.0.0 exposes them (tests/real_engines).
    llama = b"""# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
llamacpp:requests_processing_seconds 77
llamacpp:prompt_tokens_total 1000
"""
    assert parse_engine_load(vllm, engine_load_metrics("vllm")).load == 5
    assert parse_engine_load(llama, engine_load_metrics("llamacpp")).load == 7
    assert parse_engine_load(b"other_metric 4\n", ANY_ENGINE_LOAD_METRICS).load == 0


def test_engine_load_reads_only_its_engines_names_and_skips_what_it_cannot_read() -> None:
    body = b"""# HELP vllm:num_requests_running running (vllm:num_requests_running 99 in a comment)
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4 1733390000000
vllm:num_requests_waiting{engine="0",model_name="m"} NaN
vllm:num_requests_waiting{engine="1",model_name="m"} not-a-number
vllm:num_requests_waiting{engine="2",model_name="m\\\\"} 2
llamacpp:requests_processing 50
"""
    # Summed over label sets (a timestamp, an escaped label), NaN and a bad line skipped, the
    # other engine's names and the comment's mention not read.
    assert parse_engine_load(body, engine_load_metrics("vllm")) == (9, 2)
    assert parse_engine_load(body, engine_load_metrics("llamacpp")) == (50, 0)
    assert parse_engine_load(body, engine_load_metrics("megatron")) == (0, 0)


async def _metrics_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b"""# HELP vllm:num_requests_running x
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 2.0
"""
    if scope["path"].endswith("/v1/models"):
        body = json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def test_other_gateways_requests_come_from_the_scrape_and_ours_count_once() -> None:
    t = _tracker()
    t.started("r0", 1000.0)  # ours, among the engine's 5
    with serve_asgi(_metrics_app) as url:
        async with aiohttp.ClientSession() as http:
            await t.scrape(http, [endpoint("r0", url)])
    assert t.context == {"r0": 4096}
    assert t.load("r0") == 5  # 1 ours + 4 others, not 1 + 5
    # Others' requests each count the running mean of ours (one request of 1,000 so far).
    assert t.work("r0") == pytest.approx(1000.0 + 4 * t.mean_prefill)
    assert 0 < t.mean_prefill <= 1000.0


class _GatedEngine:
    """An engine that streams a role-only chunk at once, then its first token and its end
    only when the test opens each gate."""

    def __init__(self) -> None:
        self.first_token = threading.Event()
        self.finish = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if not scope["path"].endswith("/chat/completions"):
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        while (await receive()).get("more_body"):
            pass
        head = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        role = head + b'"delta":{"role":"assistant","content":""}}]}\n\n'
        await send({"type": "http.response.body", "body": role, "more_body": True})
        for gate, chunk in (
            (self.first_token, head + b'"delta":{"content":"hi"}}]}\n\n'),
            (self.finish, head + b'"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'),
        ):
            await asyncio.to_thread(gate.wait, 30)  # set from the test's thread
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def test_a_streams_prefill_is_counted_off_at_its_first_token_not_its_role_chunk() -> None:
    engine = _GatedEngine()
    key = Key("k1", "good")
    with (
        serve_asgi(engine) as engine_url,
        serve_gateway(
            # KV-event hashing declared: the route is one precise routing may score, so
            # the gateway claims what its requests compute there.
            table({"m": (replace(endpoint("r0", engine_url, api_key=SIM_KEY), hash=HASHED),)}),
            {"s1": key},
        ) as gw,
    ):
        load = gw.gateway.load
        body = {
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": "word " * 300}],
        }
        lines: list[str] = []
        computing = gw.gateway.computing
        chunks = computing.chunks(prompt_of(body, chat=True).text)

        def in_flight_claim(later: float) -> float:
            now = gw.gateway.clock() + later
            return computing.score("m\0", chunks, ["r0"], now=now)["r0"]

        def client() -> None:
            with httpx.stream(
                "POST",
                f"{gw.url}/v1/chat/completions",
                json=body,
                headers={"Authorization": "Bearer llmgw_k1_s1"},
                timeout=30,
            ) as resp:
                for line in resp.iter_lines():
                    if line:
                        lines.append(line)

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        try:
            wait_for(lambda: len(lines) >= 1, timeout_s=10, what="the role chunk relayed")
            assert '"role":"assistant"' in lines[0]
            # Relayed, and still the replica's queued prefill: no token has come.
            assert load.load("r0") == 1 and load.work("r0") >= 300
            # ... and the prompt is claimed as being computed there for as long as it takes.
            assert in_flight_claim(later=3600.0) == 1.0
            engine.first_token.set()
            wait_for(lambda: len(lines) >= 2, timeout_s=10, what="the first token relayed")
            wait_for(lambda: load.work("r0") == 0, timeout_s=5, what="the prefill counted off")
            assert load.load("r0") == 1  # still streaming
            # Computed: claimed only until KV events have had time to reach the index.
            assert in_flight_claim(later=3600.0) == 0.0
        finally:
            engine.first_token.set()
            engine.finish.set()
            thread.join(timeout=15)
        wait_for(lambda: load.load("r0") == 0, timeout_s=5, what="the request ended")
        assert not thread.is_alive() and lines[-1] == "data: [DONE]"


async def _tokenize_firehose(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = json.dumps({"count": 10**6, "tokens": list(range(10**6))}).encode()  # ~7 MB
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def test_a_tokenize_answer_far_larger_than_the_prompt_is_not_read() -> None:
    with serve_asgi(_tokenize_firehose) as url:
        async with aiohttp.ClientSession() as http:
            tok = Tokenizer(http, timeout_s=5.0, concurrency=1)
            got = await tok.tokenize(endpoint("r0", url), {"model": "m", "prompt": "hi"})
    assert got == "error"


def test_a_request_that_never_reached_its_replica_leaves_no_claim_there() -> None:
    engine = _GatedEngine()
    engine.first_token.set()
    engine.finish.set()
    key = Key("k1", "good")
    with serve_asgi(engine) as engine_url:
        live = replace(endpoint("r0", engine_url, api_key=SIM_KEY), hash=HASHED)
        dead = replace(endpoint("r0", f"http://127.0.0.1:{free_port()}", api_key=SIM_KEY),
                       hash=HASHED)  # fmt: skip
        for ep, status, claimed in ((live, 200, 1.0), (dead, 502, 0.0)):
            with serve_gateway(table({"m": (ep,)}), {"s1": key}) as gw:
                body = {
                    "model": "m",
                    "stream": True,
                    "messages": [{"role": "user", "content": "word " * 300}],
                }
                r = httpx.post(
                    f"{gw.url}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": "Bearer llmgw_k1_s1"},
                    timeout=30,
                )
                assert r.status_code == status
                computing = gw.gateway.computing
                chunks = computing.chunks(prompt_of(body, chat=True).text)
                # Right after the answer: a computed prompt is claimed until the index can
                # show it; one that failed to connect is not (the retry, or the next
                # request, must not be drawn to a replica that holds none of it).
                now = gw.gateway.clock()
                assert computing.score("m\0", chunks, ["r0"], now=now)["r0"] == claimed
