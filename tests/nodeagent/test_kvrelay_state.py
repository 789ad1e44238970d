"""KvRelay's persisted mirrors and watch bookkeeping, without an engine; and the bench, tiny.

A corrupt or foreign state file must never take a shard down (the relay starts that mirror
empty and counts it); a state file of another engine process is ignored; unwatch forgets the
shard on disk; watch is idempotent and a new generation resets the mirror. Each control plane
instance gets its own stream, one request at a time, at most ``max_sends_per_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from aiohttp import web
from prometheus_client import CollectorRegistry

from llmgw.kv import BlockStored, EventBatch, encode_batch, encode_message
from llmgw.kv.shard_views import PlacedShard, ShardViews
from llmgw.nodeagent.kvrelay.relay import KvRelay
from llmgw.protocol.kvstream import KV_PATH, decode_kv_request
from tests.support.procs import free_port
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def _relay(state: Path, registry: CollectorRegistry) -> KvRelay:
    return KvRelay(
        state_dir=state,
        auth_header=lambda: "Bearer x",
        registry=registry,
        probe_interval_s=3600,
        persist_interval_s=3600,
    )


def _publish_until(port: int, seq: int, hashes: tuple[int, ...], relay: KvRelay) -> None:
    """Send one batch from a PUB connected to the relay's SUB until the relay has applied it."""
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(f"tcp://127.0.0.1:{port}")
    payload = encode_batch(EventBatch(1.0, (BlockStored(hashes, None, (), 16, medium="GPU"),)))
    try:

        def applied() -> bool:
            pub.send_multipart(encode_message("kv@s1", seq, payload))
            view = relay.view("s1")
            return view is not None and view.last_seq == seq

        wait_for(applied, timeout_s=5, what=f"the relay to apply seq {seq}")
    finally:
        pub.close()
        ctx.term()


async def test_mirror_survives_a_restart_and_bad_state_is_skipped(tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = free_port()
    registry = CollectorRegistry()
    relay = _relay(state, registry)
    await relay.start()
    relay.watch("s1", sub_port=port, replay_port=None, model="m", engine_generation=3)
    relay.watch("s1", sub_port=port, replay_port=None, model="m", engine_generation=3)  # no-op
    _publish_until(port, 0, (11, 12), relay)
    relay.persist_now()
    await relay.close()
    saved = state / "kv" / "s1.mirror"
    assert saved.exists()

    # Same engine process: the mirror comes back with its seq, so the next live batch follows.
    relay = _relay(state, CollectorRegistry())
    await relay.start()
    relay.watch("s1", sub_port=port, replay_port=None, model="m", engine_generation=3)
    view = relay.view("s1")
    assert view is not None and view.last_seq == 0 and view.blocks == {"GPU": {11, 12}}
    assert view.block_size == 16
    # A new engine process: reset, whatever the file said.
    relay.watch("s1", sub_port=port, replay_port=None, model="m", engine_generation=4)
    view = relay.view("s1")
    assert view is not None and view.last_seq is None and not view.refcounts
    await relay.close()

    # A state file of an older engine process is ignored.
    relay = _relay(state, CollectorRegistry())
    await relay.start()
    relay.watch("s1", sub_port=port, replay_port=None, model="m", engine_generation=5)
    view = relay.view("s1")
    assert view is not None and not view.refcounts and view.engine_generation == 5
    await relay.close()

    # Corrupt and truncated files: the shard starts empty, the relay runs on, the error counts.
    for junk in (b"\x00garbage", msgpack.packb({"v": 1, "shard_id": "s1"})):
        saved.write_bytes(junk)
        registry = CollectorRegistry()
        relay = _relay(state, registry)
        await relay.start()
        relay.watch("s1", sub_port=port, replay_port=None, model="m", engine_generation=5)
        view = relay.view("s1")
        assert view is not None and not view.refcounts
        assert registry.get_sample_value("llmgw_agent_kv_state_errors_total") == 1
        _publish_until(port, 0, (21,), relay)
        relay.unwatch("s1")
        assert relay.view("s1") is None and not saved.exists()
        await relay.close()


async def test_mirrors_of_an_older_agent_in_kv_kv_are_moved_and_reloaded(tmp_path: Path) -> None:
    # Agents before the path fix kept mirrors in <state>/kv/kv/: an upgraded agent must still
    # forward-fill from them instead of starting every engine's view blind.
    state = tmp_path / "state"
    port = free_port()
    relay = _relay(state, CollectorRegistry())
    await relay.start()
    relay.watch("s1", sub_port=port, replay_port=None, model="m", engine_generation=3)
    _publish_until(port, 0, (31, 32), relay)
    relay.persist_now()
    await relay.close()
    legacy = state / "kv" / "kv"
    legacy.mkdir()
    (state / "kv" / "s1.mirror").rename(legacy / "s1.mirror")
    (legacy / "s1.tmp").write_bytes(b"cut short")

    relay = _relay(state, CollectorRegistry())
    await relay.start()
    try:
        assert not legacy.exists() and (state / "kv" / "s1.mirror").exists()
        relay.watch("s1", sub_port=port, replay_port=None, model="m", engine_generation=3)
        view = relay.view("s1")
        assert view is not None and view.last_seq == 0 and view.blocks == {"GPU": {31, 32}}
    finally:
        await relay.close()


@pytest.mark.e2e
def test_bench_runs_and_reports_the_ratio() -> None:
    out = subprocess.run(
        [sys.executable, "bench/agent_kvrelay.py", "--batches", "300"],
        capture_output=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    doc = json.loads(out.stdout)
    assert doc["batches"] == 300 and doc["block_events"] > 300
    assert set(doc["ratios"]) == {
        "relay_over_decode_floor",
        "relay_feeding_one_instance_over_decode_floor",
        "asyncio_relay_over_decode_floor",
    }
    assert doc["ratios"]["relay_over_decode_floor"] > 0


async def test_each_instance_gets_one_request_at_a_time_at_the_capped_rate(tmp_path: Path) -> None:
    arrivals: dict[str, list[float]] = {"a": [], "b": []}
    in_flight = {"a": 0, "b": 0}
    max_in_flight = {"a": 0, "b": 0}

    def handler(name: str) -> Any:
        async def handle(request: web.Request) -> web.Response:
            assert request.headers["Authorization"] == "Bearer x"
            decode_kv_request(await request.read())
            arrivals[name].append(time.monotonic())
            in_flight[name] += 1
            max_in_flight[name] = max(max_in_flight[name], in_flight[name])
            await asyncio.sleep(0.05)
            in_flight[name] -= 1
            return web.json_response({"result": "ack"})

        return handle

    runners = []
    urls = {}
    for name in arrivals:
        app = web.Application()
        app.router.add_post(KV_PATH, handler(name))
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls[name] = f"http://127.0.0.1:{port}"
    # A keepalive due at every turn: only the rate cap spaces the requests.
    relay = KvRelay(
        state_dir=tmp_path, auth_header=lambda: "Bearer x", max_sends_per_s=4, keepalive_s=0.01
    )
    await relay.start()
    try:
        relay.watch("s1", sub_port=free_port(), replay_port=None, model="m", engine_generation=1)
        relay.set_instances([("cp-a", urls["a"]), ("cp-b", urls["b"])])
        await asyncio.sleep(1.6)
    finally:
        await relay.close()
        for runner in runners:
            await runner.cleanup()
    for name, times in arrivals.items():
        assert 4 <= len(times) <= 8, (name, len(times))
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert min(gaps) >= 0.2, (name, gaps)
        assert max_in_flight[name] == 1


async def test_an_idle_stream_is_woken_by_news_not_by_its_keepalive(tmp_path: Path) -> None:
    """Changes reach an instance at once even when nothing else is due for a minute."""
    intake = ShardViews()
    placed = {"s1": PlacedShard("n", "m")}

    async def handle(request: web.Request) -> web.Response:
        result = intake.apply("n", decode_kv_request(await request.read()), placed)
        return web.json_response({"result": result})

    app = web.Application()
    app.router.add_post(KV_PATH, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    relay = KvRelay(state_dir=tmp_path, auth_header=lambda: "Bearer x", keepalive_s=60)
    await relay.start()
    try:
        sub_port = free_port()
        relay.watch("s1", sub_port=sub_port, replay_port=None, model="m", engine_generation=1)
        relay.set_instances([("cp", f"http://127.0.0.1:{port}")])
        for seq in range(3):
            await asyncio.to_thread(_publish_until, sub_port, seq, (100 + seq,), relay)
            deadline = time.monotonic() + 2
            while intake.index.num_blocks("s1") != seq + 1:
                assert time.monotonic() < deadline, f"batch {seq} did not reach the instance"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # let the stream go idle again
    finally:
        await relay.close()
        await runner.cleanup()
