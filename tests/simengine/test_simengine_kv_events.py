"""KV events from a real simulator, received on real ZMQ sockets and decoded with llmgw.kv.

The subscriber here does what the node agent does: binds a SUB on its own port (the engine's PUB
connects to it), checks sequence numbers, fills gaps from the engine's replay ROUTER through a
DEALER, and applies the events to llmgw.kv's BlockMirror (references per (hash64, medium)). Every
test ends by comparing that mirror, counts included, with the block set /debug/kv_blocks reports.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from llmgw.kv.codec import decode_batch
from llmgw.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from llmgw.kv.frames import decode_message, decode_replay_reply, encode_replay_request
from llmgw.kv.hashing import block_hashes, hash64
from llmgw.kv.mirror import BlockMirror
from tests.simengine.sim_process import HASH_SEED, SimProcess, free_port

pytestmark = pytest.mark.e2e

TOPIC = "kv@shard-1"
BLOCK_SIZE = 4
NUM_BLOCKS = 48


class Subscriber:
    """A SUB bound like the agent's, a replay DEALER, and a reference-counting mirror.

    A thread owns the SUB and polls it continuously, as the agent's listener does: a bound SUB
    attaches a connecting PUB only while it processes commands, so a SUB that is read only now
    and then silently loses the first batches (libzmq #2267).
    """

    def __init__(self, ctx: zmq.Context[Any], port: int, replay_endpoint: str) -> None:
        self._ctx = ctx
        self._replay_endpoint = replay_endpoint
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.batches: dict[int, bytes] = {}
        self.live_seqs: set[int] = set()
        self.replayed_seqs: set[int] = set()
        # llmgw.kv's own mirror, as the agent uses it: references per (hash64, medium).
        self.kv_mirror = BlockMirror()
        self.applied_up_to = -1
        self.events: list[KVEvent] = []
        # Once set, every batch from this seq on must have arrived live, none only by replay.
        self.live_from: int | None = None
        bound = threading.Event()
        self._thread = threading.Thread(target=self._listen, args=(port, bound), daemon=True)
        self._thread.start()
        assert bound.wait(5), "SUB did not bind"

    def _listen(self, port: int, bound: threading.Event) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.bind(f"tcp://127.0.0.1:{port}")
        bound.set()
        try:
            while not self._stop.is_set():
                if sub.poll(20):
                    message = decode_message(sub.recv_multipart())
                    assert message.topic == TOPIC
                    with self._lock:
                        self.batches[message.seq] = message.payload
                        self.live_seqs.add(message.seq)
        finally:
            sub.close()

    def wait_live(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self.live_seqs:
                    return True
            time.sleep(0.01)
        return False

    def replay(self, start_seq: int) -> list[int]:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        seqs: list[int] = []
        try:
            dealer.send_multipart(encode_replay_request(start_seq))
            while True:
                assert dealer.poll(5000), "replay ROUTER did not answer"
                reply = decode_replay_reply(dealer.recv_multipart())
                if reply.is_end:
                    return seqs
                assert reply.topic == TOPIC
                with self._lock:
                    self.batches.setdefault(reply.seq, reply.payload)
                    self.replayed_seqs.add(reply.seq)
                seqs.append(reply.seq)
        finally:
            dealer.close()

    def apply_ready(self) -> None:
        """Apply every batch that continues the sequence without a gap."""
        while True:
            seq = self.applied_up_to + 1
            with self._lock:
                payload = self.batches.get(seq)
            if payload is None:
                return
            batch = decode_batch(payload).batch
            self.events.extend(batch.events)
            assert self.kv_mirror.apply(seq, batch).outcome == "applied"
            assert self.kv_mirror.num_unknown_removals == 0, "removal of a block never stored"
            self.applied_up_to = seq

    @property
    def mirror(self) -> Counter[tuple[int, str]]:
        snapshot = self.kv_mirror.snapshot()
        return Counter(
            {
                (h, medium): self.kv_mirror.refcount(h, medium)
                for medium, hashes in snapshot.blocks.items()
                for h in hashes
            }
        )

    def catch_up(
        self, sim: SimProcess, deadline_s: float = 5, gap_wait_s: float = 1
    ) -> dict[str, Any]:
        """Apply batches up to the engine's last seq, filling a gap from replay as the agent does."""
        engine = httpx.get(f"{sim.base_url}/debug/kv_blocks").json()
        started = time.monotonic()
        while True:
            self.apply_ready()
            if self.applied_up_to >= engine["seq"]:
                return dict(engine)
            waited = time.monotonic() - started
            assert waited < deadline_s, (
                f"mirror stuck at seq {self.applied_up_to}, engine at {engine['seq']}"
            )
            if waited > gap_wait_s:
                self.replay(self.applied_up_to + 1)
            time.sleep(0.01)

    def assert_matches(self, sim: SimProcess) -> None:
        engine = self.catch_up(sim)
        assert engine["counts"]["running"] == 0, "compare only an idle engine"
        assert self.mirror == Counter((b["hash"], b["medium"]) for b in engine["blocks"])
        if self.live_from is not None:
            with self._lock:
                lost = set(range(self.live_from, self.applied_up_to + 1)) - self.live_seqs
            assert not lost, f"batches {sorted(lost)[:10]} never arrived live"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


@pytest.fixture(scope="module")
def wiring(
    ctx: zmq.Context[Any], sim_factory: Callable[..., SimProcess]
) -> Iterator[tuple[SimProcess, Subscriber, int]]:
    sub_port = free_port()
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(ctx, sub_port, replay_endpoint)  # bound before the engine starts
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{sub_port}",
        "replay_endpoint": replay_endpoint,
        "topic": TOPIC,
    }
    sim = sim_factory(
        "--block-size", str(BLOCK_SIZE),
        "--num-blocks", str(NUM_BLOCKS),
        "--time-scale", "0.02",
        "--lora-modules", "sql=/adapters/sql",
        "--kv-events-config", json.dumps(config),
    )  # fmt: skip
    # Warm up: the first batch may race the subscription (PUB is lossy by design); after one
    # batch has arrived live, the subscription is in place and every later batch must arrive live.
    deadline = time.monotonic() + 10
    with sim.http() as http:
        while not subscriber.live_seqs:
            assert time.monotonic() < deadline, "no live KV batch reached the SUB"
            _complete(http, "warm up the event path", max_tokens=1)
            subscriber.wait_live(0.2)
    subscriber.catch_up(sim)
    subscriber.live_from = max(subscriber.live_seqs)
    yield sim, subscriber, sub_port
    subscriber.close()


def _complete(http: httpx.Client, prompt: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    response = http.post(
        "/v1/completions",
        json={"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, **extra},
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_tokenize_and_block_hashes_reproduce_the_published_hashes(
    wiring: tuple[SimProcess, Subscriber, int],
) -> None:
    sim, subscriber, _ = wiring
    with sim.http() as http:
        prompt = "Reproduce my hashes please, all of them, block by block."
        tokens = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        seen = len(subscriber.events)
        _complete(http, prompt, max_tokens=1, model="sql", cache_salt="tenant-a")
        subscriber.catch_up(sim)
        stored = [e for e in subscriber.events[seen:] if isinstance(e, BlockStored)]
        expected = block_hashes(
            tokens,
            BLOCK_SIZE,
            seed=HASH_SEED,
            lora_name="sql",
            lora_path="/adapters/sql",
            cache_salt="tenant-a",
        )
        assert stored[0].block_hashes == tuple(hash64(h) for h in expected)
        assert stored[0].parent_block_hash is None and stored[0].lora_name == "sql"
        assert stored[0].lora_id == 1  # vLLM numbers --lora-modules from 1
        assert stored[0].token_ids == tuple(tokens[: len(expected) * BLOCK_SIZE])
        # Events carry extra keys untagged (LoRA name, salt on block 0), as vLLM publishes them.
        assert stored[0].extra_keys == (("sql", "tenant-a"), *[("sql",)] * (len(expected) - 1))

        messages = [{"role": "user", "content": "Chat prompts are hashed from the same tokens."}]
        chat_tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        seen = len(subscriber.events)
        response = http.post(
            "/v1/chat/completions",
            json={"model": "sim-model", "messages": messages, "max_tokens": 1},
        )
        assert response.status_code == 200
        subscriber.catch_up(sim)
        stored = [e for e in subscriber.events[seen:] if isinstance(e, BlockStored)]
        expected_chat = block_hashes(chat_tokens, BLOCK_SIZE, seed=HASH_SEED)
        assert stored[0].block_hashes == tuple(hash64(h) for h in expected_chat)
        # As vLLM 0.33 publishes a plain request: one extra_keys entry per block, all None,
        # and the single KV cache group's index.
        assert stored[0].extra_keys == (None,) * len(stored[0].block_hashes)
        assert stored[0].group_idx == 0 and stored[0].lora_id is None
    subscriber.assert_matches(sim)


def test_mirror_matches_engine_across_lru_evictions(
    wiring: tuple[SimProcess, Subscriber, int],
) -> None:
    sim, subscriber, _ = wiring
    with sim.http() as http:
        for _ in range(3):
            for i in range(6):
                _complete(http, f"document {i} " + "lorem ipsum dolor " * (4 + i), max_tokens=6)
            subscriber.assert_matches(sim)
        # The last round's most recent document is still cached; its first one was evicted but
        # for the first block, which every document shares ("<s>document" in 4 tokens).
        recent = _complete(http, "document 5 " + "lorem ipsum dolor " * 9, max_tokens=2)
        assert recent["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * BLOCK_SIZE
        oldest = _complete(http, "document 0 " + "lorem ipsum dolor " * 4, max_tokens=2)
        assert oldest["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCK_SIZE
    assert any(isinstance(e, BlockRemoved) for e in subscriber.events)


def test_exhausted_cache_pauses_requests_which_later_finish(
    wiring: tuple[SimProcess, Subscriber, int],
) -> None:
    sim, subscriber, _ = wiring
    before = httpx.get(f"{sim.base_url}/debug/kv_blocks").json()["counts"]

    def run(i: int) -> dict[str, Any]:
        with sim.http() as http:
            return _complete(http, f"paused request {i} says hello", max_tokens=100)

    # Each needs 28 of the 47 usable blocks at its end: alone it fits, three at once cannot.
    # Submitting while paused makes them start together (requests queue while paused).
    assert httpx.post(f"{sim.base_url}/pause").json() == {"state": "paused"}
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(run, i) for i in range(3)]
        deadline = time.monotonic() + 5
        while httpx.get(f"{sim.base_url}/debug/kv_blocks").json()["counts"]["waiting"] < 3:
            assert time.monotonic() < deadline, "requests never reached the engine"
            time.sleep(0.01)
        assert httpx.post(f"{sim.base_url}/unpause").json() == {"state": "running"}
        results = [f.result(timeout=20) for f in futures]
    assert [r["usage"]["completion_tokens"] for r in results] == [100, 100, 100]
    after = httpx.get(f"{sim.base_url}/debug/kv_blocks").json()["counts"]
    assert after["pauses_total"] > before["pauses_total"]
    subscriber.assert_matches(sim)


def test_suspend_publishes_all_blocks_cleared_and_resume_serves_again(
    wiring: tuple[SimProcess, Subscriber, int],
) -> None:
    sim, subscriber, _ = wiring
    with sim.http() as http:
        _complete(http, "fill the cache before suspending " * 3)
        subscriber.assert_matches(sim)
        assert subscriber.mirror
        assert http.post("/pause").json() == {"state": "paused"}
        assert http.post("/suspend").json() == {"state": "suspended"}
        subscriber.assert_matches(sim)
        assert not subscriber.mirror
        assert isinstance(subscriber.events[-1], AllBlocksCleared)
        http.post("/resume")
        assert http.post("/unpause").json() == {"state": "running"}
        _complete(http, "after resume the cache fills again " * 3)
    subscriber.assert_matches(sim)
    assert subscriber.mirror


def test_late_joiner_rebuilds_the_mirror_from_replay(
    ctx: zmq.Context[Any], wiring: tuple[SimProcess, Subscriber, int]
) -> None:
    sim, first, sub_port = wiring
    first.close()  # the agent goes away; the engine keeps publishing into the void
    with sim.http() as http:
        for i in range(4):
            _complete(http, f"while nobody listens {i} " * 4)
        late = Subscriber(ctx, sub_port, first._replay_endpoint)
        try:
            # The engine's PUB reconnects on its own; keep it busy until a live batch arrives.
            deadline = time.monotonic() + 10
            while not late.live_seqs:
                assert time.monotonic() < deadline, "no live batch reached the re-bound SUB"
                _complete(http, "is anyone there " * 3, max_tokens=2)
                late.wait_live(0.1)
            first_live = min(late.live_seqs)
            replayed = late.replay(0)
            assert replayed[0] == 0 and replayed[-1] >= first_live - 1
            late.assert_matches(sim)
            assert late.applied_up_to >= first_live
        finally:
            late.close()


def test_older_wire_shapes_positional_arrays_and_digests(
    ctx: zmq.Context[Any], sim_factory: Callable[..., SimProcess]
) -> None:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",  # a wildcard binds: the subscriber connects
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "legacy",
    }
    sim = sim_factory(
        "--block-size", str(BLOCK_SIZE),
        "--time-scale", "0.02",
        "--lora-modules", "sql=/adapters/sql",
        "--kv-events-config", json.dumps(config),
        "--kv-events-shape", "array",
        "--kv-events-hash", "bytes",
        "--kv-extra-key-format", "legacy",
    )  # fmt: skip
    endpoints = httpx.get(f"{sim.base_url}/debug/kv_blocks").json()["kv_events"]
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"legacy")
    sub.connect(endpoints["endpoint"])
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoints["replay_endpoint"])
    try:
        prompt = "Old engines sent positional arrays and raw digests."
        with sim.http() as http:
            tokens = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
            _complete(http, prompt, max_tokens=1, model="sql", cache_salt="tenant-b")
            deadline = time.monotonic() + 10
            while not sub.poll(50):  # live delivery starts once the subscription reached the PUB
                assert time.monotonic() < deadline, "no live batch on the bound PUB"
                _complete(http, "keep publishing", max_tokens=1)
        live = decode_message(sub.recv_multipart())
        assert live.topic == "legacy"
        dealer.send_multipart(encode_replay_request(0))
        replies = []
        while True:
            assert dealer.poll(5000)
            reply = decode_replay_reply(dealer.recv_multipart())
            if reply.is_end:
                break
            replies.append(reply)
        assert replies[0].seq == 0 and replies[0].topic is None  # <= 0.25 reply shape: no topic
        assert msgpack.unpackb(replies[0].payload)[1][0][0] == "BlockStored"  # positional event
        first = decode_batch(replies[0].payload, hash_form="raw").events[0]
        assert isinstance(first, BlockStored)
        expected = block_hashes(
            tokens,
            BLOCK_SIZE,
            seed=HASH_SEED,
            lora_name="sql",
            cache_salt="tenant-b",
            extra_key_format="legacy",
        )
        assert first.block_hashes == tuple(expected)  # full 32-byte digests
        assert first.extra_keys == (("sql", "tenant-b"), *[("sql",)] * (len(expected) - 1))
    finally:
        sub.close()
        dealer.close()
