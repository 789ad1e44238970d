"""Finding 4 (hardening-3): a queued request costs what its parsed body holds, not its raw
bytes (8 held 7.5 MB chat bodies of many small messages took RSS 208 -> 720 MB while the queue
counted 60 MB), and N models' queues may not hold N times the per-model bound.

The walk's estimate is held to tracemalloc's count on the worst shapes; through the real
gateway app, a held body is charged its walked cost against `gateway.queue_max_bytes` and
`gateway.queue_max_bytes_total`, and a request past either is refused with 429 + Retry-After
naming the bound, before it is queued."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from typing import Any

import aiohttp
import pytest

from llmgw.config import GatewaySettings
from llmgw.gateway.routes import ModelRoute, RouteTable
from llmgw.gateway.routing.held_cost import held_bytes, walk
from llmgw.gateway.wire import prompt_of
from tests.gateway.gateway_testkit import Key, serve_gateway
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

A = Key("ka", "tenant-a")
KEYS = {"sa": A}
AUTH = {"Authorization": "Bearer llmgw_ka_sa"}
MIB = 1024 * 1024


def _shapes(n: int) -> dict[str, bytes]:
    m = '{"role":"user","content":"hi"},'
    return {
        "small messages": ('{"model":"m","messages":[' + m * (n // len(m)) + m[:-1] + "]}"),
        "one long prompt": json.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * n}]}),
        "an emoji in it": json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "a" * n + "\U0001f600"}]},
            ensure_ascii=False,
        ),
        "empty lists": '{"model":"m","messages":[{"role":"user","content":"x"}],"x":['
        + "[]," * (n // 3) + "[]]}",
        "empty objects": '{"model":"m","messages":[{"role":"user","content":"x"}],"x":['
        + "{}," * (n // 3) + "{}]}",
        "floats": '{"model":"m","messages":[{"role":"user","content":"x"}],"x":['
        + "1.5," * (n // 4) + "1]}",
    }  # fmt: skip


@pytest.mark.parametrize("shape", list(_shapes(10)))
def test_the_walk_counts_what_tracemalloc_counts(shape: str) -> None:
    raw = _shapes(400_000)[shape].encode()
    gc.collect()
    tracemalloc.start()
    try:
        body = json.loads(raw)
        prompt = prompt_of(body, chat=True)
        real, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    estimate = held_bytes((body, prompt.text))
    assert 0.8 * real <= estimate <= 1.3 * real, (shape, real / len(raw), estimate / real)
    # The shapes that blow up are what the raw count missed by 8-24x.
    if shape not in ("one long prompt",):
        assert estimate > 7 * len(raw), (shape, estimate / len(raw))


def test_the_walk_gives_the_loop_back_between_slices() -> None:
    body = json.loads(_shapes(300_000)["empty lists"])
    steps = walk((body,), step=10_000)
    slices = 0
    while True:
        try:
            next(steps)
            slices += 1
        except StopIteration as done:
            total = done.value
            break
    assert slices >= 9  # 100k values in slices of 10k
    assert total == held_bytes((body,))


def _wakeable(*names: str) -> RouteTable:
    # No replica: every request is held (scale from zero), which is the queue under test.
    return RouteTable({n: ModelRoute(n, n, None, (), wakeable=True) for n in names}, 1.0)


def _many_messages(model: str, n: int = 30_000) -> bytes:
    # ~0.9 MB raw, ~8 MB parsed.
    m = b'{"role":"user","content":"hi"},'
    return (
        b'{"model":"' + model.encode() + b'","max_tokens":4,"messages":[' + m * n + m[:-1] + b"]}"
    )


async def _post(
    http: aiohttp.ClientSession, url: str, body: bytes
) -> tuple[int, dict[str, Any], str]:
    headers = {**AUTH, "Content-Type": "application/json"}
    async with http.post(f"{url}/v1/chat/completions", data=body, headers=headers) as resp:
        return resp.status, json.loads(await resp.text()), resp.headers.get("Retry-After", "")


def _held_then_refused(settings: GatewaySettings, models: tuple[str, str]) -> tuple[Any, ...]:
    with serve_gateway(_wakeable(*set(models)), KEYS, settings=settings) as gw:  # type: ignore[arg-type]
        flow = gw.gateway.flow

        async def scenario() -> tuple[Any, ...]:
            async with aiohttp.ClientSession() as http:
                first = asyncio.create_task(_post(http, gw.url, _many_messages(models[0])))
                await asyncio.to_thread(
                    wait_for, lambda: flow.held_bytes() > 0, timeout_s=10, what="one held"
                )
                held = flow.held_bytes()
                second = await _post(http, gw.url, _many_messages(models[1]))
                first.cancel()
                return held, second

        return asyncio.run(scenario())


def test_a_held_body_is_charged_what_it_holds_and_the_next_is_refused_with_429() -> None:
    # Raw bytes would let 10 such bodies wait under this bound; what they hold lets one.
    settings = GatewaySettings(queue_max_bytes=10 * MIB, queue_timeout_s=30)
    held, (status, body, retry) = _held_then_refused(settings, ("m", "m"))
    assert held > 7 * len(_many_messages("m")), held
    assert status == 429, body
    assert int(retry) >= 1
    message = body["error"]["message"]
    assert "gateway.queue_max_bytes" in message and "MiB parsed" in message, message
    assert body["error"]["code"] == "rate_limit_exceeded"


def test_all_models_queues_together_are_bounded() -> None:
    # Each model's own bound has room; the total across models does not.
    settings = GatewaySettings(
        queue_max_bytes=64 * MIB, queue_max_bytes_total=10 * MIB, queue_timeout_s=30
    )
    held, (status, body, retry) = _held_then_refused(settings, ("m", "n"))
    assert held > 0
    assert status == 429, body
    assert "gateway.queue_max_bytes_total" in body["error"]["message"], body
    assert int(retry) >= 1


def test_the_total_bound_is_a_setting_with_a_stated_default() -> None:
    settings = GatewaySettings()
    assert settings.queue_max_bytes_total == 512 * MIB
    assert settings.queue_max_bytes == 256 * MIB
