"""KvRelay end to end: a real `llmgw simengine` publishing KV events, the relay, and a receiver.

The receiver is a small aiohttp server implementing POST /agent/v1/kv with the control plane's
own ShardViews. Every check compares three views of one engine: the engine's own block list
(/debug/kv_blocks, one entry per physical block), the relay's mirror (references per hash) and
the receiver's prefix index. Scenarios: a burst of concurrent requests, duplicate blocks, frames
lost on the way (filled from replay), malformed and foreign frames, a receiver restart (need_full
then a full copy), an engine restart (new generation: reset), an agent restart (forward fill from
the persisted mirror) and a replay buffer too short to fill (partial view).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from aiohttp import web
from prometheus_client import CollectorRegistry

from llmgw.kv import PrefixIndex
from llmgw.kv.shard_views import PlacedShard, ShardViews
from llmgw.nodeagent.kvrelay.relay import KvRelay
from llmgw.nodeagent.kvrelay.stream import StreamTiming
from llmgw.protocol.kvstream import (
    KV_PATH,
    MAX_BODY_BYTES,
    KvStreamError,
    decode_kv_request,
)
from tests.simengine.sim_process import SimProcess, start_sim, stop_sim
from tests.support.procs import free_port
from tests.support.waiting import WaitTimeout, until

pytestmark = pytest.mark.e2e

SHARD = "shard-a"
NODE = "node-1"
MODEL = "sim-model"
TOKEN = "node-credential-1"
BLOCK_SIZE = 4


# --- the receiver ----------------------------------------------------------------------------


class Receiver:
    """POST /agent/v1/kv over a ShardViews, as a control plane instance serves it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.intake = ShardViews()
        self.placed = {SHARD: PlacedShard(NODE, MODEL, block_size=BLOCK_SIZE)}
        self.results: Counter[str] = Counter()
        self.resets = 0
        self.throttle_full = 0  # answer 429 to this many full copies first
        self.unauthorized = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(KV_PATH, self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.unauthorized += 1
            return web.json_response({"error": "unauthorized"}, status=401)
        try:
            delta = decode_kv_request(await request.read())
        except KvStreamError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        if delta.reset and self.throttle_full > 0:
            self.throttle_full -= 1
            self.results["throttled"] += 1
            return web.json_response({"error": "busy"}, status=429, headers={"Retry-After": "0.2"})
        result = self.intake.apply(NODE, delta, self.placed)
        self.results[result] += 1
        if delta.reset and result == "ack":
            self.resets += 1
        return web.json_response({"result": result})


def index_holds_exactly(index: PrefixIndex, blocks: dict[str, set[int]]) -> bool:
    if index.num_blocks(SHARD) != sum(len(h) for h in blocks.values()):
        return False
    return all(
        index.score(MODEL, [h], [SHARD], media=[medium])[SHARD].matched_blocks == 1
        for medium, hashes in blocks.items()
        for h in hashes
    )


# --- the engine ------------------------------------------------------------------------------


def sim_args(sub_port: int, replay_port: int, **kv: Any) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{sub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": f"kv@{SHARD}",
        **kv,
    }
    return [
        "--block-size", str(BLOCK_SIZE),
        "--num-blocks", "64",
        "--time-scale", "0.02",
        "--kv-events-config", json.dumps(config),
    ]  # fmt: skip


async def engine_blocks(sim: SimProcess) -> Counter[tuple[int, str]] | None:
    """The engine's physical blocks by (hash, medium), or None while requests still run."""
    async with httpx.AsyncClient(timeout=5) as http:
        state = (await http.get(f"{sim.base_url}/debug/kv_blocks")).json()
    if state["counts"]["running"] or state["counts"]["waiting"]:
        return None
    return Counter((b["hash"], b["medium"]) for b in state["blocks"])


async def complete(
    http: httpx.AsyncClient, sim: SimProcess, prompt: str, max_tokens: int = 4
) -> None:
    response = await http.post(
        f"{sim.base_url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
    )
    assert response.status_code == 200, response.text


async def eventually(check: Callable[[], Awaitable[str | None]], *, timeout_s: float) -> None:
    """Await until ``check`` returns None (agreement); fail with its last complaint."""
    complaint: str | None = "never checked"

    async def agreed() -> bool:
        nonlocal complaint
        complaint = await check()
        return complaint is None

    try:
        await until(agreed, timeout_s=timeout_s, what="the views to agree", interval_s=0.05)
    except WaitTimeout:
        raise AssertionError(f"views never agreed within {timeout_s}s: {complaint}") from None


def agreement(
    sim: SimProcess, relay: KvRelay, receiver: Receiver, *, partial: bool = False
) -> Callable[[], Awaitable[str | None]]:
    async def check() -> str | None:
        engine = await engine_blocks(sim)
        if engine is None:
            return "engine busy"
        view = relay.view(SHARD)
        if view is None:
            return "relay has no view"
        if Counter(dict(view.refcounts)) != engine:
            return f"relay {len(view.refcounts)} blocks != engine {len(engine)}"
        if view.partial != partial:
            return f"relay partial={view.partial}"
        blocks: dict[str, set[int]] = {}
        for h, medium in engine:
            blocks.setdefault(medium, set()).add(h)
        if not index_holds_exactly(receiver.intake.index, blocks):
            return f"receiver holds {receiver.intake.index.num_blocks(SHARD)} != {len(engine)}"
        if receiver.intake.index.is_partial(SHARD) != partial:
            return "receiver partial flag differs"
        return None

    return check


class Dropper:
    """The relay's frame filter: loses the next ``n`` live frames, as an overflowing HWM would."""

    def __init__(self) -> None:
        self.n = 0
        self.dropped: list[int] = []

    def __call__(self, shard: str, seq: int) -> bool:
        if self.n > 0:
            self.n -= 1
            self.dropped.append(seq)
            return False
        return True


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def make_relay(state_dir: Path, registry: CollectorRegistry, **kw: Any) -> KvRelay:
    return KvRelay(
        state_dir=state_dir,
        auth_header=lambda: f"Bearer {TOKEN}",
        registry=registry,
        max_sends_per_s=50,
        keepalive_s=0.3,
        timing=StreamTiming(full_copy_jitter_s=0.1, retry_min_s=0.05, retry_max_s=0.5),
        probe_interval_s=0.5,
        persist_interval_s=0.2,
        **kw,
    )


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver(free_port())
    await r.start()
    yield r
    await r.stop()


@pytest.fixture
def sims(tmp_path: Path) -> Any:
    started: list[SimProcess] = []

    async def start(*args: str) -> SimProcess:
        sim = await asyncio.to_thread(start_sim, tmp_path, *args)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        stop_sim(sim)


# --- the scenarios ---------------------------------------------------------------------------


async def test_relay_keeps_the_receiver_equal_to_the_engine(
    tmp_path: Path, receiver: Receiver, sims: Any
) -> None:
    registry = CollectorRegistry()
    dropper = Dropper()
    relay = make_relay(tmp_path / "state", registry, frame_filter=dropper)
    sub_port, replay_port = free_port(), free_port()
    await relay.start()
    try:
        relay.set_instances([("cp-1", receiver.url)])
        relay.watch(SHARD, sub_port=sub_port, replay_port=replay_port, model=MODEL,
                    engine_generation=1)  # fmt: skip
        sim = await sims(*sim_args(sub_port, replay_port))
        async with httpx.AsyncClient(timeout=30) as http:
            # A burst: 24 concurrent requests with shared and distinct prefixes, evicting.
            await asyncio.gather(
                *(complete(http, sim, f"topic {i % 5} " + "lorem ipsum " * (3 + i % 7))
                  for i in range(24))
            )  # fmt: skip
            await eventually(agreement(sim, relay, receiver), timeout_s=10)

            # Batches received live, not only by replay: a burst published before the SUB's
            # subscription reached the engine (ZMQ's slow joiner, seen on loaded cores) comes
            # only from replay; a request sent after that travels live.
            async def live() -> str | None:
                if sample(registry, "llmgw_agent_kv_batches_total", shard=SHARD) > 0:
                    return None
                await complete(http, sim, "one request more " * 4)
                return "no batch received live"

            await eventually(live, timeout_s=10)
            await eventually(agreement(sim, relay, receiver), timeout_s=10)

            # Duplicate blocks: two identical prompts computed in the same step hold two
            # physical blocks per hash; the engine lists both, the mirror counts two references.
            assert (await http.post(f"{sim.base_url}/pause")).json() == {"state": "paused"}
            twins = asyncio.gather(*(complete(http, sim, "twin prompt " * 6) for _ in range(2)))
            deadline = time.monotonic() + 5
            while (await http.get(f"{sim.base_url}/debug/kv_blocks")).json()["counts"][
                "waiting"
            ] < 2:
                assert time.monotonic() < deadline, "twins never queued"
                await asyncio.sleep(0.02)
            await http.post(f"{sim.base_url}/unpause")
            await twins
            engine = await engine_blocks(sim)
            assert engine is not None and max(engine.values()) == 2, "no duplicate blocks"
            await eventually(agreement(sim, relay, receiver), timeout_s=10)
            # Evicting one twin's blocks must leave the hash held (one reference left).
            for i in range(6):
                await complete(http, sim, f"evict {i} " + "dolor sit amet " * 5)
            await eventually(agreement(sim, relay, receiver), timeout_s=10)

            # Lost frames: the next live batches never reach the mirror; the next one reveals
            # the gap and replay fills it.
            dropper.n = 2
            for i in range(4):
                await complete(http, sim, f"gap {i} " + "consectetur " * 4)
            await eventually(agreement(sim, relay, receiver), timeout_s=10)
            assert len(dropper.dropped) == 2
            assert sample(registry, "llmgw_agent_kv_gaps_total", shard=SHARD, outcome="filled") >= 1
            assert sample(registry, "llmgw_agent_kv_gaps_total", shard=SHARD, outcome="reset") == 0

            # Malformed and foreign frames on the SUB port: counted, dropped, never fatal.
            ctx: zmq.Context[Any] = zmq.Context()
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.connect(f"tcp://127.0.0.1:{sub_port}")
            try:
                deadline = time.monotonic() + 5
                while sample(registry, "llmgw_agent_kv_malformed_frames_total", shard=SHARD) < 1:
                    assert time.monotonic() < deadline, "malformed frames never counted"
                    pub.send_multipart(
                        [f"kv@{SHARD}".encode(), (10**6).to_bytes(8, "big"), b"\xc1junk"]
                    )
                    pub.send_multipart([f"kv@{SHARD}".encode(), b"short", b""])
                    # Prefix-matches the SUB filter but is another shard's topic.
                    pub.send_multipart([f"kv@{SHARD}0".encode(), (0).to_bytes(8, "big"), b""])
                    await asyncio.sleep(0.05)
                assert sample(registry, "llmgw_agent_kv_foreign_frames_total", shard=SHARD) >= 1
            finally:
                pub.close()
                ctx.term()
            await complete(http, sim, "after the junk " * 4)
            await eventually(agreement(sim, relay, receiver), timeout_s=10)

            # Receiver restart, same id and URL, engine idle: the keepalive draws need_full.
            await receiver.stop()
            fresh = Receiver(receiver.port)
            fresh.throttle_full = 1  # and the first full copy is refused with 429
            await fresh.start()
            receiver._runner = fresh._runner  # the fixture stops whichever runs
            await eventually(agreement(sim, relay, fresh), timeout_s=10)
            assert fresh.results["need_full"] >= 1 and fresh.results["throttled"] == 1
            assert fresh.resets >= 1
            assert sample(registry, "llmgw_agent_kv_results_total", instance="cp-1",
                          result="throttled") == 1  # fmt: skip

            # Engine restart: the supervisor reports a new generation; the mirror resets and
            # follows the new process from seq 0.
            await asyncio.to_thread(stop_sim, sim)
            relay.watch(SHARD, sub_port=sub_port, replay_port=replay_port, model=MODEL,
                        engine_generation=2)  # fmt: skip
            sim = await sims(*sim_args(sub_port, replay_port))
            for i in range(5):
                await complete(http, sim, f"second life {i} " + "adipiscing " * 4)
            await eventually(agreement(sim, relay, fresh), timeout_s=10)
            assert sample(registry, "llmgw_agent_kv_resets_total", shard=SHARD,
                          reason="engine_restart") == 1  # fmt: skip
            view = relay.view(SHARD)
            assert (
                view is not None and view.engine_generation == 2 and view.block_size == BLOCK_SIZE
            )
            assert receiver.unauthorized == fresh.unauthorized == 0
    finally:
        await relay.close()


async def test_restarted_agent_forward_fills_from_replay_or_marks_partial(
    tmp_path: Path, receiver: Receiver, sims: Any
) -> None:
    state = tmp_path / "state"
    sub_port, replay_port = free_port(), free_port()
    relay = make_relay(state, CollectorRegistry())
    await relay.start()
    relay.set_instances([("cp-1", receiver.url)])
    relay.watch(SHARD, sub_port=sub_port, replay_port=replay_port, model=MODEL,
                engine_generation=7)  # fmt: skip
    sim = await sims(*sim_args(sub_port, replay_port, buffer_steps=10))
    async with httpx.AsyncClient(timeout=30) as http:
        for i in range(4):
            await complete(http, sim, f"before {i} " + "lorem " * 6)
        await eventually(agreement(sim, relay, receiver), timeout_s=10)
        await relay.close()  # the agent stops; its mirror is persisted
        assert list((state / "kv").glob("*.mirror"))

        # Requests while the agent is down: a few batches, well inside the replay buffer.
        for i in range(3):
            await complete(http, sim, f"while down {i} " + "ipsum " * 6)
        relay = make_relay(state, CollectorRegistry())
        await relay.start()
        try:
            relay.set_instances([("cp-1", receiver.url)])
            relay.watch(SHARD, sub_port=sub_port, replay_port=replay_port, model=MODEL,
                        engine_generation=7)  # fmt: skip
            # No new request: the forward fill alone must bring the view up to date.
            await eventually(agreement(sim, relay, receiver), timeout_s=10)
        finally:
            await relay.close()

        # Down for longer than the replay buffer covers: the view comes back partial.
        for i in range(30):
            await complete(http, sim, f"long outage {i} " + "dolor " * 3, max_tokens=2)
        relay = make_relay(state, CollectorRegistry())
        await relay.start()
        try:
            relay.set_instances([("cp-1", receiver.url)])
            relay.watch(SHARD, sub_port=sub_port, replay_port=replay_port, model=MODEL,
                        engine_generation=7)  # fmt: skip

            async def partial_everywhere() -> str | None:
                view = relay.view(SHARD)
                if view is None or not view.partial:
                    return "relay view not partial"
                if not receiver.intake.index.is_partial(SHARD):
                    return "receiver not told"
                return None

            await eventually(partial_everywhere, timeout_s=10)
        finally:
            await relay.close()
