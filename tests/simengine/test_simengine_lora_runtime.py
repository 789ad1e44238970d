"""Runtime LoRA adapters: the registry's rules, then the routes over the in-process app.

The registry tests drive `LoraRegistry` with a plain number as the clock. The HTTP tests run the
real app and engine in this process (httpx's ASGI transport). KV events come back over the
engine's real replay ROUTER, so the test reads the same bytes a node agent would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from llmgw.errors import ConfigError, ConflictError, NotFoundError, SpecError
from llmgw.kv.codec import decode_batch
from llmgw.kv.events import BlockRemoved, BlockStored, KVEvent
from llmgw.kv.frames import decode_replay_reply, encode_replay_request
from llmgw.kv.hashing import block_hashes, hash64
from llmgw.simengine.config import (
    KvEventsConfig,
    LoraModule,
    SimEngineConfig,
    parse_allow_runtime_lora_updating,
)
from llmgw.simengine.engine import SimEngine
from llmgw.simengine.http_app import build_app
from llmgw.simengine.lora_runtime import LoraRegistry, LoraRequestCounts, LoraSlotsFullError
from llmgw.simengine.scheduler import SchedulerConfig
from llmgw.simengine.timing import TimingModel
from tests.support.procs import free_port
from tests.support.waiting import until

BASE = "sim-model"
BLOCK_SIZE = 4


def _registry(*names: str, capacity: int = 2, load_time_s: float = 0.5) -> LoraRegistry:
    return LoraRegistry(
        [LoraModule(n, f"/adapters/{n}") for n in names],
        base_model=BASE,
        max_cpu_loras=capacity,
        load_time_s=load_time_s,
    )


def _load(
    registry: LoraRegistry,
    name: str,
    *,
    now: float = 0.0,
    path: str | None = None,
    busy: Collection[int] = (),
    load_inplace: bool = False,
) -> int:
    """Load `name` and register it at once; its id."""
    pending = registry.begin_load(
        name,
        path or f"/adapters/{name}",
        now=now,
        busy=busy,
        path_exists=lambda _: True,
        load_inplace=load_inplace,
    )
    registry.settle(pending.ready_at)
    return pending.adapter.lora_id


def _held_names(registry: LoraRegistry) -> list[str]:
    return [name for _, name in registry.held()]


# ---- the registry ---------------------------------------------------------------------------


def test_static_modules_are_numbered_from_one_and_the_cache_keeps_the_last_loaded() -> None:
    registry = _registry("a", "b", "c", capacity=2)
    assert [(a.name, a.lora_id) for a in registry.adapters()] == [("a", 1), ("b", 2), ("c", 3)]
    # vLLM loads --lora-modules one by one into its CPU cache: the first fell out, still listed.
    assert _held_names(registry) == ["b", "c"]
    assert registry.get("a") is not None


def test_a_load_registers_only_when_its_time_has_come() -> None:
    registry = _registry("a", load_time_s=0.5)
    pending = registry.begin_load(
        "new", "/adapters/new", now=10.0, busy=(), path_exists=lambda _: True
    )
    assert pending.ready_at == 10.5
    assert registry.pending_until("new") == 10.5
    assert registry.settle(10.49) == ()
    assert registry.get("new") is None
    assert [a.name for a in registry.adapters()] == ["a"]
    assert registry.settle(10.5) == (pending.adapter,)
    assert registry.get("new") == pending.adapter
    assert registry.pending_until("new") is None
    assert [a.name for a in registry.adapters()] == ["a", "new"]


def test_a_second_load_of_a_name_in_flight_is_refused_until_the_first_is_done() -> None:
    registry = _registry()
    registry.begin_load("x", "/p", now=0, busy=(), path_exists=lambda _: True)
    with pytest.raises(ConflictError, match="still loading"):
        registry.begin_load("x", "/p", now=0.1, busy=(), path_exists=lambda _: True)


def test_ids_are_never_handed_out_twice() -> None:
    registry = _registry("a", "b", capacity=4)
    assert _load(registry, "x") == 3
    registry.unload("x")
    assert _load(registry, "x") == 4  # unloading does not give the id back
    # A load that fails on its path has spent its id, as vLLM's does (the id comes first).
    with pytest.raises(NotFoundError):
        registry.begin_load("y", "/gone", now=0, busy=(), path_exists=lambda _: False)
    # vLLM's resolve_lora spends one on a request for an unknown model.
    registry.note_unknown_model()
    assert _load(registry, "z") == 7
    # In place keeps the id.
    assert _load(registry, "z", path="/adapters/z2", load_inplace=True) == 7


def test_a_reload_in_place_serves_the_old_adapter_until_the_new_one_is_ready() -> None:
    registry = _registry("a", "b")
    pending = registry.begin_load(
        "a", "/adapters/a-v2", now=0, busy=(), path_exists=lambda _: True, load_inplace=True
    )
    assert pending.in_place
    old = registry.get("a")
    assert old is not None and old.path == "/adapters/a"
    registry.settle(pending.ready_at)
    new = registry.get("a")
    assert new is not None and (new.lora_id, new.path) == (1, "/adapters/a-v2")
    assert [a.name for a in registry.adapters()] == ["a", "b"]  # it keeps its place


@pytest.mark.parametrize(
    ("name", "path", "error", "message"),
    [
        ("", "/p", SpecError, "Both 'lora_name' and 'lora_path' must be provided."),
        ("x", "", SpecError, "Both 'lora_name' and 'lora_path' must be provided."),
        (BASE, "/p", SpecError, f"The lora adapter '{BASE}' conflicts with a served base model."),
        (
            "a",
            "/p",
            SpecError,
            "The lora adapter 'a' has already been loaded. If you want to load the adapter in "
            "place, set 'load_inplace' to True.",
        ),
        ("x", "/gone", NotFoundError, "Loading lora x failed: No adapter found for /gone"),
    ],
)
def test_a_load_is_refused_with_vllms_message(
    name: str, path: str, error: type[Exception], message: str
) -> None:
    registry = _registry("a")
    with pytest.raises(error) as caught:
        registry.begin_load(name, path, now=0, busy=(), path_exists=lambda p: p != "/gone")
    assert str(caught.value) == message
    assert [a.name for a in registry.adapters()] == ["a"]
    assert registry.pending_until(name) is None


def test_an_unload_is_refused_with_vllms_message() -> None:
    registry = _registry("a")
    with pytest.raises(SpecError, match=r"^'lora_name' needs to be provided"):
        registry.unload("")
    with pytest.raises(NotFoundError, match=r"^The lora adapter 'b' cannot be found\.$"):
        registry.unload("b")


def test_loading_past_the_limit_evicts_the_least_recently_used_idle_adapter() -> None:
    registry = _registry("a", "b", capacity=2)
    registry.activate({1}, busy=set)  # a was used last
    pending = registry.begin_load("c", "/adapters/c", now=0, busy=(), path_exists=lambda _: True)
    assert [a.name for a in pending.held.evicted] == ["b"]
    registry.settle(pending.ready_at)
    assert _held_names(registry) == ["a", "c"]
    # Evicted is not unregistered: b stays listed and servable.
    assert registry.get("b") is not None


def test_an_adapter_in_use_is_not_evicted_and_a_full_cache_refuses_the_load() -> None:
    registry = _registry("a", "b", capacity=2)
    with pytest.raises(LoraSlotsFullError) as caught:
        registry.begin_load("c", "/adapters/c", now=0, busy={1, 2}, path_exists=lambda _: True)
    message = str(caught.value)
    assert "all 2 adapter slots (--max-cpu-loras)" in message
    assert "(a, b)" in message and "larger --max-cpu-loras" in message
    assert _held_names(registry) == ["a", "b"]  # a refusal evicts nothing
    assert registry.get("c") is None and registry.pending_until("c") is None
    # Only a is in use: b, though used more recently than a, is the one to go.
    registry.activate({2}, busy=set)
    pending = registry.begin_load("c", "/adapters/c", now=0, busy={1}, path_exists=lambda _: True)
    assert [a.name for a in pending.held.evicted] == ["b"]


def test_a_load_in_flight_holds_its_slot() -> None:
    registry = _registry("a", capacity=2)
    registry.begin_load("x", "/adapters/x", now=0, busy=(), path_exists=lambda _: True)
    second = registry.begin_load("y", "/adapters/y", now=0, busy=(), path_exists=lambda _: True)
    assert [a.name for a in second.held.evicted] == ["a"]  # not x, which is still loading
    with pytest.raises(LoraSlotsFullError, match=r"\(x, y\)"):
        registry.begin_load("z", "/adapters/z", now=0, busy=(), path_exists=lambda _: True)


def test_a_batch_reads_an_evicted_adapter_again() -> None:
    registry = _registry("a", "b", capacity=1)
    assert _held_names(registry) == ["b"]
    change = registry.activate({1}, busy=set)
    assert [a.name for a in change.loaded] == ["a"]
    assert [a.name for a in change.evicted] == ["b"]
    assert registry.activate({1}, busy=set).loaded == ()  # held now: nothing to read


def test_a_batch_wider_than_the_cache_is_held_over_the_limit_until_idle() -> None:
    registry = _registry("a", "b", capacity=1)
    change = registry.activate({1, 2}, busy=lambda: {1, 2})
    assert [a.name for a in change.loaded] == ["a"] and change.evicted == ()
    assert sorted(_held_names(registry)) == ["a", "b"]
    assert registry.trim(lambda: {1, 2}) == ()  # both still in use
    evicted = registry.trim(lambda: {1})
    assert [a.name for a in evicted] == ["b"]
    assert _held_names(registry) == ["a"]


def test_an_unloaded_adapter_stays_held_until_it_is_the_victim() -> None:
    # vLLM's unload only unregisters; its CPU cache drops the adapter by LRU later.
    registry = _registry("a", "b", capacity=2)
    registry.unload("a")
    assert _held_names(registry) == ["a", "b"]
    pending = registry.begin_load("c", "/adapters/c", now=0, busy=(), path_exists=lambda _: True)
    assert [a.name for a in pending.held.evicted] == ["a"]


def test_request_counts_keep_vllms_order() -> None:
    counts = LoraRequestCounts()
    for name in ("a", "b", "a"):
        counts.add(name)
    counts.remove("a")
    assert counts.names() == ("a", "b")
    counts.remove("a")
    counts.add("a")  # back after its last request finished: to the end, as in vLLM's dict
    assert counts.names() == ("b", "a")


@pytest.mark.parametrize(
    ("raw", "allowed"),
    [(None, False), ("", False), ("0", False), ("yes", False), ("1", True), (" TRUE ", True)],
)
def test_the_gate_reads_the_variable_as_vllm_does(raw: str | None, allowed: bool) -> None:
    assert parse_allow_runtime_lora_updating(raw) is allowed


def test_max_cpu_loras_below_max_loras_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        SimEngineConfig(max_loras=2, max_cpu_loras=1)
    assert SimEngineConfig(max_loras=3).lora_capacity == 3


# ---- over HTTP ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _serving(**fields: Any) -> AsyncIterator[tuple[SimEngine, httpx.AsyncClient]]:
    settings: dict[str, Any] = {
        "timing": TimingModel(time_scale=0),
        "allow_runtime_lora_updating": True,
        "lora_load_time_s": 0.05,
        **fields,
    }
    engine = SimEngine(SimEngineConfig(**settings))
    await engine.start()
    try:
        await until(lambda: engine.ready, timeout_s=5, what="the engine to be ready")
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            yield engine, client
    finally:
        await engine.stop()


def _adapter_dir(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.mkdir()
    return str(path)


async def _load_http(client: httpx.AsyncClient, name: str, path: str) -> httpx.Response:
    return await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


async def _chat(client: httpx.AsyncClient, model: str, text: str, **extra: Any) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": text}], **extra},
        timeout=30,
    )


async def _model_ids(client: httpx.AsyncClient) -> list[str]:
    response = await client.get("/v1/models")
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


async def _replayed_events(endpoint: str) -> list[KVEvent]:
    """Every batch the engine's replay ROUTER still buffers, from seq 0, decoded."""
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    events: list[KVEvent] = []
    try:
        await dealer.send_multipart(encode_replay_request(0))
        while True:
            reply = decode_replay_reply(await asyncio.wait_for(dealer.recv_multipart(), 5))
            if reply.is_end:
                return events
            events.extend(decode_batch(reply.payload).batch.events)
    finally:
        dealer.close()
        ctx.term()


async def test_without_the_gate_the_routes_do_not_exist(tmp_path: Path) -> None:
    async with _serving(allow_runtime_lora_updating=False) as (_, client):
        loaded = await _load_http(client, "x", _adapter_dir(tmp_path, "x"))
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert (loaded.status_code, unloaded.status_code) == (404, 404)
        assert "x" not in await _model_ids(client)


async def test_the_routes_need_the_api_key(tmp_path: Path) -> None:
    async with _serving(api_key="k") as (_, client):
        path = _adapter_dir(tmp_path, "x")
        refused = await _load_http(client, "x", path)
        assert refused.status_code == 401
        accepted = await client.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "x", "lora_path": path},
            headers={"Authorization": "Bearer k"},
        )
        assert accepted.status_code == 200, accepted.text


async def test_a_loaded_adapter_answers_chat_and_its_kv_events_name_it(tmp_path: Path) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    kv_events = KvEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=replay,
        topic="kv@lora",
    )
    async with _serving(
        kv_events=kv_events,
        scheduler=SchedulerConfig(block_size=BLOCK_SIZE, num_blocks=256),
        lora_modules=(LoraModule("sql", "/adapters/sql"),),
        max_cpu_loras=2,
    ) as (engine, client):
        path = _adapter_dir(tmp_path, "support")
        loaded = await _load_http(client, "support", path)
        # vLLM's answer: the bare text, no content type.
        assert loaded.status_code == 200
        assert loaded.text == "Success: LoRA adapter 'support' added successfully."
        assert "content-type" not in loaded.headers
        models = (await client.get("/v1/models")).json()["data"]
        card = next(m for m in models if m["id"] == "support")
        assert (card["parent"], card["root"]) == (BASE, path)

        messages = [{"role": "user", "content": "Route this ticket to the right team, please."}]
        tokens = (await client.post("/tokenize", json={"messages": messages})).json()["tokens"]
        answered = await client.post(
            "/v1/chat/completions",
            json={"model": "support", "messages": messages, "max_tokens": 2},
        )
        assert answered.status_code == 200, answered.text
        assert answered.json()["model"] == "support"

        stored = [e for e in await _replayed_events(replay) if isinstance(e, BlockStored)]
        assert stored, "no BlockStored event was published"
        first = stored[0]
        # The first runtime adapter takes the id after the one --lora-modules entry.
        assert (first.lora_name, first.lora_id) == ("support", 2)
        expected = block_hashes(
            tokens, BLOCK_SIZE, seed=engine.config.hash_seed, lora_name="support", lora_path=path
        )
        assert first.block_hashes == tuple(hash64(h) for h in expected)


async def test_a_request_for_an_adapter_still_loading_waits_for_it(tmp_path: Path) -> None:
    async with _serving(lora_load_time_s=1.5) as (engine, client):
        loop = asyncio.get_running_loop()
        load = asyncio.create_task(_load_http(client, "slow", _adapter_dir(tmp_path, "slow")))
        ready_at = await until(
            lambda: engine.adapters.pending_until("slow"),
            timeout_s=5,
            what="the load to start",
        )
        assert "slow" not in await _model_ids(client)  # not registered while it loads
        answered = await _chat(client, "slow", "wait for me", max_tokens=2)
        # vLLM's per-name lock: the request waited for the load and ran, instead of a 404.
        assert answered.status_code == 200, answered.text
        assert loop.time() >= ready_at
        assert (await load).status_code == 200
        assert "slow" in await _model_ids(client)


async def test_a_missing_path_fails_the_load_naming_it(tmp_path: Path) -> None:
    async with _serving() as (_, client):
        missing = str(tmp_path / "no-such-adapter")
        refused = await _load_http(client, "ghost", missing)
        assert refused.status_code == 404
        assert refused.json()["error"]["message"] == (
            f"Loading lora ghost failed: No adapter found for {missing}"
        )
        assert "ghost" not in await _model_ids(client)
        assert (await _chat(client, "ghost", "hi", max_tokens=1)).status_code == 404


async def test_unloading_makes_the_adapter_unknown_and_keeps_its_blocks(tmp_path: Path) -> None:
    async with _serving(scheduler=SchedulerConfig(block_size=BLOCK_SIZE)) as (engine, client):
        assert (await _load_http(client, "tmp", _adapter_dir(tmp_path, "tmp"))).status_code == 200
        answered = await _chat(client, "tmp", "a prompt long enough to fill blocks", max_tokens=2)
        assert answered.status_code == 200, answered.text
        before = (await client.get("/debug/kv_blocks")).json()

        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "tmp"})
        assert unloaded.status_code == 200
        assert unloaded.text == "Success: LoRA adapter 'tmp' removed successfully."
        assert "tmp" not in await _model_ids(client)
        gone = await _chat(client, "tmp", "hi", max_tokens=1)
        assert gone.status_code == 404
        assert gone.json()["error"]["message"].startswith("The model `tmp` does not exist")
        # vLLM's unload only unregisters: no block leaves the prefix cache, no event is sent.
        after = (await client.get("/debug/kv_blocks")).json()
        assert after["blocks"] and after["blocks"] == before["blocks"]
        assert not any(isinstance(e, BlockRemoved) for e in engine.scheduler.take_events())

        again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "tmp"})
        assert again.status_code == 404
        assert again.json()["error"]["message"] == "The lora adapter 'tmp' cannot be found."


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        ({"lora_name": "sql", "lora_path": "{dir}"}, {}, 400, "has already been loaded"),
        ({"lora_name": BASE, "lora_path": "{dir}"}, {}, 400, "conflicts with a served base model"),
        ({"lora_name": "x"}, {}, 400, "lora_path: Field required"),
        ({"lora_name": "", "lora_path": "{dir}"}, {}, 400, "Both 'lora_name' and 'lora_path'"),
        (
            {"lora_name": "x", "lora_path": "{dir}"},
            {"content-type": "text/plain"},
            400,
            "Unsupported Media Type: Only 'application/json' is allowed",
        ),
    ],
)
async def test_a_bad_load_gets_vllms_status_and_message(
    tmp_path: Path, body: dict[str, str], headers: dict[str, str], status: int, message: str
) -> None:
    path = _adapter_dir(tmp_path, "dir")
    async with _serving(lora_modules=(LoraModule("sql", "/adapters/sql"),)) as (_, client):
        filled = {k: v.replace("{dir}", path) for k, v in body.items()}
        response = await client.post(
            "/v1/load_lora_adapter",
            content=json.dumps(filled),
            headers={"content-type": "application/json", **headers},
        )
        assert response.status_code == status
        assert message in response.json()["error"]["message"]


async def test_a_full_cache_refuses_a_load_until_its_adapter_is_idle(tmp_path: Path) -> None:
    # One slot. A request for `a` holds KV while the engine is paused, so `a` is in use.
    async with _serving(timing=TimingModel(step_overhead_ms=5.0), max_loras=1, max_cpu_loras=1) as (
        engine,
        client,
    ):
        assert (await _load_http(client, "a", _adapter_dir(tmp_path, "a"))).status_code == 200
        running = asyncio.create_task(_chat(client, "a", "keep me busy", max_tokens=200))
        await until(lambda: engine.scheduler.num_running == 1, timeout_s=5, what="a to run")
        assert (await client.post("/pause")).status_code == 200

        refused = await _load_http(client, "b", _adapter_dir(tmp_path, "b"))
        assert refused.status_code == 503
        assert "--max-cpu-loras" in refused.json()["error"]["message"]
        assert "b" not in await _model_ids(client)

        assert (await client.post("/unpause")).status_code == 200
        assert (await running).status_code == 200
        loaded = await _load_http(client, "b", str(tmp_path / "b"))
        assert loaded.status_code == 200, loaded.text
        assert [name for _, name in engine.adapters.held()] == ["b"]
        # a was evicted, not unloaded: still listed, and a request reads it back in.
        assert "a" in await _model_ids(client)
        assert (await _chat(client, "a", "back again", max_tokens=1)).status_code == 200
        assert [name for _, name in engine.adapters.held()] == ["a"]


async def test_lora_requests_info_is_exposed_as_vllm_does() -> None:
    async with _serving(allow_runtime_lora_updating=False) as (_, client):
        text = (await client.get("/metrics")).text
        assert "vllm:lora_requests_info" not in text  # no adapters: vLLM without --enable-lora

    async with _serving(lora_modules=(LoraModule("sql", "/adapters/sql"),), max_loras=2) as (
        _,
        client,
    ):
        assert (await _chat(client, "sql", "count me", max_tokens=3)).status_code == 200
        text = (await client.get("/metrics")).text
        family = next(
            f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
        )
        series = {
            (s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"]): s
            for s in family.samples
        }
        assert {s.labels["max_lora"] for s in family.samples} == {"2"}
        assert {frozenset(s.labels) for s in family.samples} == {
            frozenset({"max_lora", "running_lora_adapters", "waiting_lora_adapters"})
        }
        # The request was counted while unfinished, and the last stamp says none is left.
        assert ("sql", "sql") in series and ("", "") in series
        assert series[("", "")].value >= series[("sql", "sql")].value
