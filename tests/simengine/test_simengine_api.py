"""The simulator's HTTP API against a real `llmgw simengine` process, through the official openai client."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.simengine.sim_process import API_KEY, SimProcess

pytestmark = pytest.mark.e2e

MODEL = "sim"
STEP_OVERHEAD_MS = 2.0
PREFILL_MS_PER_TOKEN = 0.05
BUDGET = 2048


@pytest.fixture(scope="module")
def sim(sim_factory: Callable[..., SimProcess]) -> SimProcess:
    return sim_factory(
        "--model", "/models/sim-7b",
        "--served-model-name", MODEL,
        "--lora-modules", "sql=/adapters/sql",
        "--lora-modules", "chat=/adapters/chat",
        "--load-time-s", "1.5",
        "--max-num-batched-tokens", str(BUDGET),
        "--step-overhead-ms", str(STEP_OVERHEAD_MS),
        "--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN),
        env={"SIMENGINE_API_KEY": API_KEY},
    )  # fmt: skip


def _client(sim: SimProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key=API_KEY, max_retries=0)


def _metric(sim: SimProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{sim.base_url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_health_is_503_while_loading_then_reports_the_state(sim: SimProcess) -> None:
    assert sim.health_statuses[0] == 503 and sim.health_statuses[-1] == 200
    assert httpx.get(f"{sim.base_url}/health").json() == {"state": "running"}


def test_sync_client_completions_chat_and_models(sim: SimProcess) -> None:
    client = _client(sim)
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, "sql", "chat"]
    first = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, seed=5)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, seed=5)
    assert first.choices[0].text == again.choices[0].text != ""
    assert first.usage is not None and first.usage.completion_tokens == 7
    tokens = httpx.post(f"{sim.base_url}/tokenize", json={"prompt": "Once upon a time"}).json()
    assert first.usage.prompt_tokens == tokens["count"]
    assert first.choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "Write one line about caches."}]
    chat = client.chat.completions.create(model="sql", messages=messages, max_tokens=5)  # type: ignore[arg-type]
    assert chat.model == "sql" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    chat_tokens = httpx.post(
        f"{sim.base_url}/tokenize", json={"model": "sql", "messages": messages}
    ).json()
    assert chat.usage is not None and chat.usage.prompt_tokens == chat_tokens["count"]
    detok = httpx.post(f"{sim.base_url}/detokenize", json={"tokens": chat_tokens["tokens"]}).json()
    assert detok["prompt"].startswith("<|im_start|>user\nWrite one line about caches.<|im_end|>")


async def test_async_client_streams_exactly_the_non_streamed_text(sim: SimProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{sim.base_url}/v1", api_key=API_KEY, max_retries=0)
    messages: Any = [{"role": "user", "content": "Stream me something."}]
    whole = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, seed=9
    )
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        seed=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    finish = None
    usage = None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12
    completions = await client.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, stream=True
    )
    texts = [c.choices[0].text async for c in completions]
    assert len(texts) == 4 and all(texts)
    await client.close()


def test_stop_strings_end_the_completion(sim: SimProcess) -> None:
    client = _client(sim)
    full = client.completions.create(model=MODEL, prompt="stop test", max_tokens=30, seed=1)
    text = full.choices[0].text
    stop = text[10:13]
    cut = client.completions.create(
        model=MODEL, prompt="stop test", max_tokens=30, seed=1, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_api_key_guards_v1_only_and_errors_have_openai_shape(sim: SimProcess) -> None:
    bad = openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    raw = httpx.post(f"{sim.base_url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert raw.status_code == 401 and set(raw.json()["error"]) >= {"message", "type", "code"}
    assert httpx.get(f"{sim.base_url}/metrics").status_code == 200
    assert httpx.post(f"{sim.base_url}/tokenize", json={"prompt": "x"}).status_code == 200

    client = _client(sim)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 32768"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=40_000)
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=2)
    missing = httpx.get(f"{sim.base_url}/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    broken = httpx.post(
        f"{sim.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert broken.status_code == 400 and "not JSON" in broken.json()["error"]["message"]


def _ttft_stream(sim: SimProcess, prompt: str) -> tuple[float, int, int]:
    client = _client(sim)
    started = time.perf_counter()
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft = None
    usage = None
    for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            usage = chunk.usage
    assert ttft is not None and usage is not None and usage.prompt_tokens_details is not None
    return ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_shared_prefix_is_cached_and_lowers_ttft_as_modelled(sim: SimProcess) -> None:
    run = time.monotonic_ns()
    prefix = f"run {run}: " + " ".join(f"word{i}" for i in range(1500))
    ttft_a, tokens_a, cached_a = _ttft_stream(sim, prefix + " first question")
    ttft_b, tokens_b, cached_b = _ttft_stream(sim, prefix + " a different question")
    assert cached_a == 0
    ids_a = httpx.post(
        f"{sim.base_url}/tokenize", json={"prompt": prefix + " first question"}
    ).json()["tokens"]
    ids_b = httpx.post(
        f"{sim.base_url}/tokenize", json={"prompt": prefix + " a different question"}
    ).json()["tokens"]
    common = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=False)) if a != b)
    assert cached_b == min(common // 16, (tokens_b - 1) // 16) * 16
    assert cached_b > 0.9 * tokens_b

    def modelled_s(uncached: int) -> float:
        steps = -(-uncached // BUDGET)
        return (steps * STEP_OVERHEAD_MS + uncached * PREFILL_MS_PER_TOKEN) / 1000

    model_a = modelled_s(tokens_a)
    model_b = modelled_s(tokens_b - cached_b)
    assert model_a > 0.1  # the prompt is long enough for the model to dominate HTTP noise
    assert ttft_a >= 0.95 * model_a
    assert ttft_b < model_b + 0.1  # HTTP and scheduling noise on a shared machine
    assert ttft_b < 0.4 * ttft_a


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(sim: SimProcess) -> None:
    aborted_before = _metric(sim, "vllm:request_success_total", finished_reason="abort")
    body = json.dumps(
        {"model": MODEL, "prompt": "a long story " * 50, "max_tokens": 5000, "stream": True}
    ).encode()
    host, port = sim.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while received.count(b'"text":') < 3:
            chunk = conn.recv(65536)
            assert chunk, "server closed the stream early"
            received += chunk
        running = httpx.get(f"{sim.base_url}/debug/kv_blocks").json()["counts"]
        assert running["running"] == 1 and running["free_blocks"] < 4095
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        counts = httpx.get(f"{sim.base_url}/debug/kv_blocks").json()["counts"]
        if counts["running"] == 0 and counts["free_blocks"] == 4095:
            break
        time.sleep(0.02)
    assert counts["running"] == 0 and counts["waiting"] == 0 and counts["free_blocks"] == 4095
    assert _metric(sim, "vllm:request_success_total", finished_reason="abort") == aborted_before + 1


def test_metrics_carry_vllm_names(sim: SimProcess) -> None:
    # A labelled counter appears once a request has ended: send one here, since the tests
    # that also do may run on another worker.
    # The same long prompt twice: the second hits the prefix cache.
    for _ in range(2):
        httpx.post(
            f"{sim.base_url}/v1/completions",
            json={"model": MODEL, "prompt": "Once upon a time " * 40, "max_tokens": 2},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=30,
        ).raise_for_status()
    text = httpx.get(f"{sim.base_url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_success_total",
    ):
        assert re.search(rf'^{re.escape(name)}\{{.*model_name="{MODEL}"', text, re.M), name
    assert re.search(
        r'^vllm:cache_config_info\{.*block_size="16".*num_gpu_blocks="4096"', text, re.M
    )
    assert _metric(sim, "vllm:prefix_cache_hits_total") > 0
    assert _metric(sim, "vllm:generation_tokens_total") > 0


async def test_pause_holds_requests_and_suspend_follows_megatrons_transitions(
    sim: SimProcess,
) -> None:
    async with httpx.AsyncClient(base_url=sim.base_url, timeout=10) as http:
        refused = await http.post("/suspend")
        assert refused.status_code == 409
        assert "allowed only from paused" in refused.json()["error"]["message"]
        assert (await http.post("/pause")).json() == {"state": "paused"}
        assert (await http.get("/health")).json() == {"state": "paused"}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        pending = asyncio.create_task(
            http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "held", "max_tokens": 3},
                headers=headers,
            )
        )
        done, _ = await asyncio.wait({pending}, timeout=0.3)
        assert not done, "a request completed while the engine was paused"
        assert (await http.post("/suspend")).json() == {"state": "suspended"}
        health = await http.get("/health")
        assert health.status_code == 200 and health.json() == {"state": "suspended"}
        assert (await http.get("/debug/kv_blocks")).json()["blocks"] == []
        assert (await http.post("/resume")).json() == {"state": "paused"}
        assert (await http.post("/unpause")).json() == {"state": "running"}
        response = await asyncio.wait_for(pending, timeout=5)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_cache_salt_isolates_tenants_and_lora_adapters_from_the_base_model(sim: SimProcess) -> None:
    client = _client(sim)
    prompt = f"tenant isolation {time.monotonic_ns()} " + "shared words " * 40

    def cached(model: str = MODEL, salt: str | None = None) -> int:
        extra = {"cache_salt": salt} if salt else None
        result = client.completions.create(
            model=model, prompt=prompt, max_tokens=1, extra_body=extra
        )
        assert result.usage is not None and result.usage.prompt_tokens_details is not None
        return result.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(salt="tenant-a") == 0
    assert cached(salt="tenant-b") == 0  # same tokens, other tenant: no shared blocks
    assert cached(salt="tenant-a") > 0
    assert cached() == 0  # unsalted requests never hit salted blocks either
    assert cached(model="sql") == 0  # nor does a LoRA adapter hit the base model's blocks
    assert cached(model="sql") > 0
