"""The gateway in the real system: a `llmgw controlplane` process (gateway on its public
listener), a real agent with 4 simulated GPUs running 4 `sim` replicas with kv_events, keys
made through the admin API, and the official `openai` client.

Proves: the client works unchanged with a key (sync, async, streaming); 401/404/429/503 in
OpenAI's shape with real keys and limits (a deployment without replicas is 503, not 404);
requests sharing a long system prompt land on the replica holding it, by precise decisions
(engines' `cached_tokens` and `llmgw_prefix_decisions_total`); two salted keys never share a
cached block; scaling down loses no request; SIGTERM finishes open streams, then flushes usage; after the control plane
is killed and started again, precise decisions resume within seconds, from the agents' full
copies. The tests share one fleet and run in this order.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.gateway_fleet import GatewayFleet, metric_value
from tests.pg_harness import PgServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "chat"
SIM_ARGS = ["--time-scale", "0.05", "--num-blocks", "2048"]
SYSTEM = " ".join(f"rule{i} says the assistant keeps answer {i} brief." for i in range(120))


@pytest.fixture(scope="module")
def gfleet(
    pg_server: PgServer, _pg_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayFleet]:
    name = pg_server.new_name("gw")
    url = pg_server.create_database(name, template=_pg_template)
    f = GatewayFleet(db_url=url, tmp=tmp_path_factory.mktemp("gwfleet"))
    try:
        f.start_controlplane("cp")
        f.start_agent("node-a", gpus=4)
        f.sim_kv_deployment(MODEL, replicas=4, args=SIM_ARGS)
        f.until(lambda: len(f.ready_shards(MODEL)) == 4, timeout_s=60, what="4 ready replicas")
        yield f
    finally:
        f.close()
        pg_server.drop_database(name)


@pytest.fixture(scope="module")
def key(gfleet: GatewayFleet) -> str:
    return gfleet.create_key("e2e-main")


def _client(f: GatewayFleet, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{f.public['cp']}/v1", api_key=key, max_retries=0, timeout=20)


def _wait_routable(f: GatewayFleet, key: str) -> None:
    client = _client(f, key)

    def ok() -> bool:
        try:
            client.completions.create(model=MODEL, prompt="ping", max_tokens=1)
        except openai.APIError:
            return False
        return True

    f.until(ok, timeout_s=30, what="the gateway to route to the model")


def _ask(client: openai.OpenAI, question: str) -> int:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
    )
    assert r.usage is not None
    details = r.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


def _precise_hits(f: GatewayFleet) -> float:
    return metric_value(
        f.cp, "llmgw_prefix_decisions_total", model=MODEL, method="precise", outcome="hit"
    )


def _precise(f: GatewayFleet) -> float:
    return metric_value(f.cp, "llmgw_prefix_decisions_total", model=MODEL, method="precise")


def _tokens_not_had(f: GatewayFleet) -> float:
    """Requests precise routing could not tokenize: the replica's /tokenize failed (a local
    failure, ``local_*``, is asked of a replica next, so it is not one)."""
    text = httpx.get(f"{f.cp.url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("llmgw_prefix_tokenize_failures_total{")
            and 'reason="local_' not in line
        ):
            total += float(line.rpartition(" ")[2])
    return total


def test_openai_client_sync_async_streaming_with_a_key(gfleet: GatewayFleet, key: str) -> None:
    _wait_routable(gfleet, key)
    client = _client(gfleet, key)
    assert MODEL in [m.id for m in client.models.list()]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.choices[0].message.content and r.usage and r.usage.completion_tokens == 3
    pieces = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        if c.choices
    ]
    assert len([p for p in pieces if p]) == 4

    async def run() -> int:
        aclient = openai.AsyncOpenAI(base_url=f"{gfleet.public['cp']}/v1", api_key=key)
        done = await asyncio.gather(
            *(
                aclient.completions.create(model=MODEL, prompt=f"q{i}", max_tokens=2)
                for i in range(6)
            )
        )
        await aclient.close()
        return len(done)

    assert asyncio.run(run()) == 6
    with pytest.raises(openai.AuthenticationError):
        _client(gfleet, key[:-2] + "xx").models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


def test_error_cases_with_real_keys_and_limits(gfleet: GatewayFleet, key: str) -> None:
    _wait_routable(gfleet, key)
    url = f"{gfleet.public['cp']}/v1/completions"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}

    def post(api_key: str | None, payload: dict[str, object] = body) -> httpx.Response:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.post(url, json=payload, headers=headers, timeout=10)

    def shape(r: httpx.Response, status: int, code: str) -> None:
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == code

    shape(post(None), 401, "invalid_api_key")
    shape(post(gfleet.create_key("only-other", models=["other"])), 404, "model_not_found")
    limited = gfleet.create_key("one-a-minute", rpm=1)
    assert post(limited).status_code == 200
    r = post(limited)
    shape(r, 429, "rate_limit_exceeded")
    assert int(r.headers["retry-after"]) >= 1
    # A deployment with no replica: a known model with nothing ready (503), not unknown.
    gfleet.sim_kv_deployment("idle", replicas=0, args=SIM_ARGS)
    gfleet.until(
        lambda: post(key, {**body, "model": "idle"}).status_code == 503,
        timeout_s=10,
        what="the idle model in the route table",
    )
    shape(post(key, {**body, "model": "idle"}), 503, "no_ready_replica")


def test_a_shared_system_prompt_lands_on_the_replica_holding_it(
    gfleet: GatewayFleet, key: str
) -> None:
    _wait_routable(gfleet, key)
    client = _client(gfleet, key)
    first = _ask(client, "question zero")
    assert first == 0  # nobody held it
    # The engine's KV events reach the index through the agent within moments; wait for the
    # first precise hit rather than sleeping.
    before = _precise_hits(gfleet)
    gfleet.until(
        lambda: _ask(client, f"warm {time.monotonic()}") > 0 and _precise_hits(gfleet) > before,
        timeout_s=20,
        what="a precise decision on the shared system prompt",
    )
    hits = _precise_hits(gfleet)
    cached = [_ask(client, f"question {i}") for i in range(6)]
    # Every one lands where the system prompt is cached (a random pick would hold it 1 in 4).
    print("cached per request:", cached)
    system_tokens = min(cached)
    assert system_tokens > 100, cached
    assert _precise_hits(gfleet) - hits == 6


def test_two_salted_keys_never_share_a_cached_block(gfleet: GatewayFleet) -> None:
    a = _client(gfleet, gfleet.create_key("tenant-a", cache_salt=True))
    b = _client(gfleet, gfleet.create_key("tenant-b", cache_salt=True))
    _wait_routable(gfleet, gfleet.create_key("probe"))
    prompt = "a confidential preamble shared by both tenants. " * 30

    def cached(client: openai.OpenAI) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(a) == 0
    gfleet.until(lambda: cached(a) > 0, timeout_s=20, what="tenant a to hit its own blocks")
    # Tenant b's identical prompt hits nothing anywhere: the salt is hashed into block 0.
    assert cached(b) == 0


def test_scaling_down_loses_no_request(gfleet: GatewayFleet, key: str) -> None:
    _wait_routable(gfleet, key)
    client = _client(gfleet, key)
    stop = threading.Event()
    failures: list[str] = []
    done = [0]

    def fire() -> None:
        while not stop.is_set():
            try:
                client.completions.create(model=MODEL, prompt="during the drain", max_tokens=2)
                done[0] += 1
            except openai.APIError as exc:
                failures.append(repr(exc))

    workers = [threading.Thread(target=fire) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        gfleet.admin("POST", f"/deployments/{MODEL}/scale", {"replicas": 2})
        gfleet.until(
            lambda: len(gfleet.ready_shards(MODEL)) == 2,
            timeout_s=30,
            what="two active replicas left, the others draining",
        )
        # Keep going past the drain deadline (1 s here), when the drained engines stop.
        until = time.monotonic() + 4
        before = done[0]
        gfleet.until(
            lambda: time.monotonic() > until and done[0] > before + 20,
            timeout_s=30,
            what="requests through and after the drain",
        )
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=20)
    assert failures == [], failures[:3]


def test_sigterm_finishes_open_streams_then_flushes_usage(gfleet: GatewayFleet, key: str) -> None:
    _wait_routable(gfleet, key)
    client = _client(gfleet, gfleet.create_key("e2e-sigterm"))
    stream = client.completions.create(
        model=MODEL,
        prompt="a long story",
        max_tokens=1000,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = iter(stream)
    assert next(chunks).choices  # the stream is open
    cp = gfleet.cp
    cp.signal(signal.SIGTERM)
    signalled = time.monotonic()
    rest = list(chunks)
    # The stream outlived the signal (else this test would prove nothing).
    streamed_after_s = time.monotonic() - signalled
    assert len(rest) > 100 and streamed_after_s > 0.05, (len(rest), streamed_after_s)
    # Finished, not cut: the last chunk carries the usage of all 1000 tokens.
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 1000
    assert cp.proc.wait(timeout=30) == 0, cp.log_text()[-3000:]
    # ... and the usage was flushed on the way out (nothing else used this key).
    rows = gfleet.sql(
        "SELECT coalesce(sum(u.completion_tokens), 0) FROM usage_buckets u "
        "JOIN api_keys k ON k.id = u.api_key_id WHERE k.name = 'e2e-sigterm'"
    )
    assert rows[0][0] == 1000
    print(f"streamed {streamed_after_s:.2f}s after SIGTERM")
    gfleet.start_controlplane("cp")


def test_precise_routing_resumes_after_a_control_plane_restart(
    gfleet: GatewayFleet, key: str
) -> None:
    _wait_routable(gfleet, key)
    client = _client(gfleet, key)
    _ask(client, "before the restart")
    cp = gfleet.cp
    cp.signal(signal.SIGKILL)
    cp.proc.wait(timeout=10)
    started = time.monotonic()
    gfleet.start_controlplane("cp")
    assert _precise_hits(gfleet) == 0  # a new process: an empty index, nothing counted yet
    gfleet.until(
        lambda: _ask(client, f"after {time.monotonic()}") > 0 and _precise_hits(gfleet) > 0,
        timeout_s=30,
        what="precise decisions after the restart",
    )
    resumed_s = time.monotonic() - started
    hits, precise, unasked = _precise_hits(gfleet), _precise(gfleet), _tokens_not_had(gfleet)
    assert all(_ask(client, f"then {i}") > 100 for i in range(3))
    # Each is decided by the precise tier, unless its tokens could not be had in time (a
    # replica's /tokenize past its timeout on loaded cores: routed by the tree by design, and
    # counted). A precise decision may still pass over the replica holding the prefix when
    # the load view says it is overloaded (seen on loaded cores): a decision, not a hit.
    decided, fell_back = _precise(gfleet) - precise, _tokens_not_had(gfleet) - unasked
    assert decided + fell_back == 3, (decided, fell_back)
    assert _precise_hits(gfleet) - hits >= 1
    # Seconds, not the agents' 15 s keepalive: full copies follow the first new event.
    assert resumed_s < 30, resumed_s
    print(f"precise routing resumed {resumed_s:.1f}s after the restart began")


def test_gateway_logs_no_secrets(gfleet: GatewayFleet, key: str) -> None:
    text = Path(gfleet.cp.log).read_text(errors="replace")
    assert key not in text and key.split("_", 2)[2] not in text  # the secret may hold "_"
