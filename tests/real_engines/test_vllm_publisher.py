"""vLLM's own KV-event publisher feeding a real agent's relay and the control plane's index.

vLLM cannot run here, but ``vllm/distributed/kv_events.py`` is plain Python: it is brought from
pinned vLLM releases (tests/support/vllm_source.py; cached after the first download) and run
as the engine side of a real fleet: `llmgw controlplane` on a throwaway database, `llmgw agent`
with two GPUs from an inventory file, and a deployment per release whose `vllm` profile's command is
tests/support/vllm_event_engine.py: it takes the flags llmgw's vLLM adapter emits and hands
``--kv-events-config`` (endpoint the agent binds, replay endpoint, topic ``kv@<shard>``) to
vLLM's own config class and ``ZmqEventPublisher``. Two releases, one per event encoding: 0.33.0
(the newest llmgw supports: tagged maps, replay replies with a topic) and 0.23.0 (positional
arrays, replay replies without one), side by side on the same agent.

The engine publishes what the test says; the test keeps the block set it published, by
(hash, medium) with references, and every check requires the control plane's index
(``GET /admin/v1/debug/kv/{shard}``) to equal it, complete and not partial:
- after a burst (stores with chains, duplicate blocks, per-block removals, CPU offload
  stores, a hash sent as 32 bytes);
- after frames lost on the wire (forward-filled from vLLM's own replay ROUTER);
- after the agent is killed with SIGKILL and batches are published while it is down (the
  restarted agent forward-fills from replay, with no new batch to reveal the gap);
- after AllBlocksCleared.

A frame format change in a newer vLLM shows here as a failure. vLLM's PUB drops what it sends
before the subscription of a (re)connected SUB has reached it (ZMQ's slow joiner): batches
published just after the agent restarts may be lost with no later batch to reveal the gap, and
the relay's own fill for a quiet engine comes after 30 s. So a check that has not agreed for a
second publishes a one-block nudge, which reveals such a lost tail as a gap (filled from replay
like any other, so a nudge cannot hide a view that went partial).
"""

from __future__ import annotations

import contextlib
import json
import random
import stat
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from llmgw.kv import decode_batch
from llmgw.nodeagent.procs import kill_marked
from tests.nodeagent.agent_harness import AgentProcess
from tests.nodeagent.realcp import RealControlPlane
from tests.support.procs import agent_port_base, free_port
from tests.support.vllm_source import NEWEST, OLDER, SourceUnavailable, fetch, load_kv_events
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.real_engine, pytest.mark.e2e, pytest.mark.timeout(120)]

BLOCK_SIZE = 16  # the profile's kv_hash.block_size (its default): the index refuses another
_ENGINE = Path(__file__).resolve().parents[1] / "support" / "vllm_event_engine.py"
_MASK64 = (1 << 64) - 1
GPU_CLASS = "h100"
# (shape of the events on the wire, as vLLM's own encoder wrote them) per release.
SHAPES = {NEWEST: "map", OLDER: "array"}


@pytest.fixture(scope="session")
def vllm_sources() -> dict[str, Path]:
    """vLLM's kv_events.py per release, fetched once into the user's cache."""
    try:
        return {v: fetch(v, log=lambda line: print(line, file=sys.stderr)) for v in SHAPES}
    except SourceUnavailable as exc:
        pytest.skip(f"vLLM's own KV-event publisher could not be fetched, NOT tested: {exc}")


# --- the codec: every field vLLM encodes, as llmgw decodes it --------------------------------

# A value for every field of vLLM's events through 0.33, none of them a default: a field vLLM
# adds later has no value here, and the test names it.
_VALUES: dict[str, Any] = {
    "block_hashes": [(1 << 64) - 1, bytes(range(32))],  # int mode and a 32-byte digest
    "parent_block_hash": 12345,
    "token_ids": list(range(100, 100 + 2 * BLOCK_SIZE)),
    "block_size": BLOCK_SIZE,
    "lora_id": 7,
    "medium": "CPU",
    "lora_name": "adapter-a",
    "extra_keys": [("adapter-a", ("mm-1", 0)), None],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 4096,
    "locality": "REMOTE",
    "ownership": "tier-2",
    "session_id": "session-1",
    "lookahead_token_ids": [[17, 18], [19, 20]],
}


def _frozen(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


@pytest.fixture
def vllm_module(request: pytest.FixtureRequest, vllm_sources: dict[str, Path]) -> Iterator[Any]:
    """vLLM's kv_events.py of the requested release, imported here; the stubs go afterwards."""
    saved = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    try:
        yield load_kv_events(vllm_sources[request.param])
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.parametrize("vllm_module", list(SHAPES), indirect=True)
def test_llmgw_decodes_every_field_of_vllms_own_encoding(vllm_module: Any) -> None:
    kv = vllm_module
    events = []
    for cls in (kv.BlockStored, kv.BlockRemoved):
        names = [f.name for f in msgspec.structs.fields(cls)]
        unknown = [n for n in names if n not in _VALUES]
        assert not unknown, f"vLLM's {cls.__name__} has fields llmgw.kv does not know: {unknown}"
        events.append(cls(**{n: _VALUES[n] for n in names}))
    events.append(kv.AllBlocksCleared())
    # Encoded as vLLM's publisher thread encodes a batch.
    payload = msgspec.msgpack.Encoder().encode(
        kv.KVEventBatch(ts=1.5, events=events, data_parallel_rank=3)
    )
    batch = decode_batch(payload, hash_form="raw").batch
    assert (batch.ts, batch.data_parallel_rank, len(batch.events)) == (1.5, 3, 3)
    for theirs, ours in zip(events, batch.events, strict=True):
        assert type(ours).__name__ == type(theirs).__name__
        for f in msgspec.structs.fields(type(theirs)):
            assert getattr(ours, f.name) == _frozen(getattr(theirs, f.name)), f.name
    # The int form the relay keys blocks by: a digest's last 8 bytes, big-endian.
    stored = decode_batch(payload).batch.events[0]
    assert stored.block_hashes == ((1 << 64) - 1, int.from_bytes(bytes(range(24, 32)), "big"))


# --- the engines -----------------------------------------------------------------------------

Event = dict[str, Any]


@dataclass
class Engine:
    """One engine running vLLM's publisher, and the block set the test made it publish."""

    version: str
    shard_id: str
    http_port: int
    blocks: Counter[tuple[int, str]] = field(default_factory=Counter)
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=15))

    def publish(self, *batches: list[Event], lost: tuple[int, ...] = ()) -> dict[str, Any]:
        """Publish ``batches`` in order (those at indexes ``lost`` never reach the wire)."""
        body = {"batches": [{"events": b, "lost": i in lost} for i, b in enumerate(batches)]}
        r = self.http.post(f"http://127.0.0.1:{self.http_port}/publish", json=body)
        assert r.status_code == 200, r.text
        for batch in batches:
            for event in batch:
                self._apply(event)
        answer: dict[str, Any] = r.json()
        assert answer["shape"] == SHAPES[self.version], answer
        return answer

    def control_calls(self) -> list[str]:
        """The sleep and wake calls the engine received, in order (its test-only route)."""
        r = self.http.get(f"http://127.0.0.1:{self.http_port}/control_calls")
        assert r.status_code == 200, r.text
        calls: list[str] = r.json()
        return calls

    def _apply(self, event: Event) -> None:
        if event["type"] == "AllBlocksCleared":
            self.blocks.clear()
            return
        medium = event.get("medium") or "GPU"
        for h in event["block_hashes"]:
            key = (_u64(h), medium)
            self.blocks[key] += 1 if event["type"] == "BlockStored" else -1
            assert self.blocks[key] >= 0, f"the test removed a block it never stored: {key}"
        self.blocks = +self.blocks  # drops zero counts

    def expected(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for h, medium in self.blocks:
            out.setdefault(medium, []).append(h)
        return {m: sorted(hs) for m, hs in out.items()}

    # --- what vLLM's scheduler would publish, roughly ------------------------------------

    def _hash(self) -> int:
        return self.rng.getrandbits(64)

    def stores(self, n_blocks: int, *, medium: str = "GPU") -> Event:
        """One request's newly full blocks: a chain, ``BLOCK_SIZE`` tokens per block."""
        hashes = [self._hash() for _ in range(n_blocks)]
        if medium != "GPU":  # an offload: hash only, as vLLM's OffloadingConnector sends it
            return {"type": "BlockStored", "block_hashes": hashes, "token_ids": [],
                    "block_size": 0, "medium": medium}  # fmt: skip
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": self.rng.choice([None, self._hash()]),
            "token_ids": [self.rng.randrange(50_000) for _ in range(n_blocks * BLOCK_SIZE)],
            "block_size": BLOCK_SIZE,
            "medium": "GPU",
        }

    def burst(self, n_batches: int) -> list[list[Event]]:
        """Steps' batches: new chains, a twin (a block stored twice: two references), evictions
        (one BlockRemoved per physical block), an offload, and a hash sent as 32 bytes."""
        held = Counter(self.blocks)
        batches: list[list[Event]] = []
        for step in range(n_batches):
            events = [self.stores(self.rng.randint(1, 4)) for _ in range(self.rng.randint(1, 3))]
            if step % 4 == 1:  # a duplicate of a block already held
                twin = dict(events[0], block_hashes=events[0]["block_hashes"][:1])
                events.append(twin)
            if step % 5 == 2:
                events.append(self.stores(2, medium="CPU"))
            if step == 3:
                digest = self.rng.randbytes(32)
                events.append(dict(self.stores(1), block_hashes=[{"bin": digest.hex()}]))
            for e in events:
                held.update((_u64(h), e["medium"]) for h in e["block_hashes"])
            for key in self.rng.sample(sorted(held.elements()), k=min(3, sum(held.values()))):
                h, medium = key
                events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": medium})
                held[key] -= 1
            held = +held
            batches.append(events)
        return batches


def _u64(h: int | dict[str, str]) -> int:
    """The hash as the index keys it: an int as uint64, 32 bytes as their last 8, big-endian."""
    if isinstance(h, dict):
        return int.from_bytes(bytes.fromhex(h["bin"])[-8:], "big")
    return h & _MASK64


# --- the fleet -------------------------------------------------------------------------------


class Fleet:
    def __init__(self, db_url: str, tmp: Path, sources: dict[str, Path]) -> None:
        self.tmp = tmp
        self.cp = RealControlPlane(db_url, tmp / "controlplane.log").start()
        self.listen, self.base = free_port(), agent_port_base()
        self.agents: list[AgentProcess] = []
        # The adapter's configured `vllm`: vLLM's publisher behind the adapter's flags.
        self.wrapper = tmp / "vllm"
        self.wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{_ENGINE}" "$@"\n')
        self.wrapper.chmod(self.wrapper.stat().st_mode | stat.S_IXUSR)
        self.sources = sources
        # GPUs as data (the one hardware fake): only the sim engine may use simulated ones.
        self.inventory = tmp / "inventory.json"
        gpus = [
            {
                "index": i,
                "uuid": f"GPU-vllm-{i}",
                "name": "NVIDIA H100 80GB HBM3",
                "gpu_class": GPU_CLASS,
                "memory_total_mb": 81559,
            }
            for i in range(len(sources))
        ]
        self.inventory.write_text(json.dumps({"gpus": gpus}))
        self.engines: list[Engine] = []

    def start_agent(self) -> AgentProcess:
        agent = AgentProcess(
            state_dir=self.tmp / "state",
            controlplane_url=self.cp.url,
            listen_port=self.listen,
            log_path=self.tmp / f"agent-{len(self.agents)}.log",
            port_range=(self.base, self.base + 63),
            token=self.cp.bootstrap_token(),
            node_name="vllm-node",
            extra_args=("--inventory-file", str(self.inventory)),
            extra_env={"LLMGW_AGENT__ENGINES": json.dumps({"vllm": {"path": str(self.wrapper)}})},
        ).start()
        self.agents.append(agent)
        return agent

    def deploy(self) -> list[Engine]:
        docs: list[dict[str, Any]] = []
        for version, source in self.sources.items():
            name = _deployment(version)
            docs += [
                {"kind": "model", "name": name},
                {"kind": "profile", "name": name, "model": name, "engine": "vllm",
                 "gpu_class": GPU_CLASS, "model_path": f"/models/{name}", "kv_events": True,
                 # Appended to the adapter's flags: which release's publisher to run, and
                 # vLLM's sleep mode, which makes its replicas suspendable.
                 "args": ["--vllm-source", str(source), "--enable-sleep-mode"]},
                {"kind": "deployment", "name": name, "model": name, "profile": name,
                 "replicas": 1},
            ]  # fmt: skip
        self.cp.apply(docs)
        engines = self.engines
        for version in self.sources:
            shard = wait_for(
                lambda v=version: self._ready(_deployment(v)),
                timeout_s=60,
                what=f"the vLLM {version} engine placed and ready",
            )
            engines.append(Engine(version, shard["id"], shard["http_port"]))
        return engines

    def _ready(self, deployment: str) -> dict[str, Any] | None:
        self.cp.assert_alive()
        self.agents[-1].assert_alive()
        shards = self.cp.shards(deployment)
        return shards[0] if shards and shards[0]["state"] == "ready" else None

    def disagreement(self, engine: Engine) -> str | None:
        """None when the control plane's index holds exactly the engine's blocks."""
        view = self.cp.kv_view(engine.shard_id)
        if view is None:
            return "the control plane holds no view"
        have = {m: hs for m, hs in view["blocks"].items() if hs}
        want = engine.expected()
        if have != want:
            counts = {m: len(hs) for m, hs in have.items()}
            published = {m: len(hs) for m, hs in want.items()}
            return f"index {counts} != published {published}"
        if view["partial"] or not view["complete"]:
            return f"view partial={view['partial']} complete={view['complete']}"
        return None

    def agree(self, engines: list[Engine], what: str, timeout_s: float = 20) -> None:
        """Wait until the index equals every engine's blocks; a second without agreement gets a
        nudge (one new block), which reveals a batch lost last as a gap (module docstring)."""
        deadline = time.monotonic() + timeout_s
        for engine in engines:
            nudge_at = time.monotonic() + 1.0
            while (complaint := self.disagreement(engine)) is not None:
                self.cp.assert_alive()
                self.agents[-1].assert_alive()
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what}: vLLM {engine.version}: {complaint}")
                if time.monotonic() > nudge_at:
                    engine.publish([engine.stores(1)])
                    nudge_at = time.monotonic() + 1.0
                time.sleep(0.05)

    def close(self) -> None:
        for engine in self.engines:
            engine.http.close()
        for agent in self.agents:
            agent.terminate()
        self.cp.stop()


def _deployment(version: str) -> str:
    return "vllm-" + version.replace(".", "-")


@pytest.fixture
def fleet(db_url: str, tmp_path: Path, vllm_sources: dict[str, Path]) -> Iterator[Fleet]:
    f = Fleet(db_url, tmp_path, vllm_sources)
    try:
        yield f
    finally:
        # The engines outlive their agent by design (adoption): kill them by their marker.
        shard_ids = {e.shard_id for e in f.engines}
        with contextlib.suppress(Exception):  # the control plane may be what failed
            shard_ids |= {s["id"] for v in vllm_sources for s in f.cp.shards(_deployment(v))}
        f.close()
        for sid in shard_ids:
            kill_marked(sid)


# --- the test --------------------------------------------------------------------------------


def test_vllms_own_publisher_keeps_the_index_equal_to_its_blocks(fleet: Fleet) -> None:
    fleet.start_agent()
    engines = fleet.deploy()

    # A burst: steps' batches back to back, as a busy scheduler publishes them.
    for e in engines:
        answer = e.publish(*e.burst(24))
        assert answer["seqs"][-1] >= 23
    fleet.agree(engines, "after a burst")
    assert all(e.blocks and max(e.blocks.values()) >= 2 for e in engines), "no duplicate blocks"
    assert all(any(m == "CPU" for _, m in e.blocks) for e in engines), "no offloaded blocks"

    # Frames lost on the wire: two batches never arrive; the third reveals the gap, and the
    # relay fills it from vLLM's replay ROUTER (each release's reply shape).
    for e in engines:
        e.publish(*e.burst(3), lost=(0, 1))
    fleet.agree(engines, "after lost frames")
    # (A gap may also have come earlier, from batches sent before the PUB read the
    # subscription: filled the same way.)
    gaps = Counter((g["shard"], g["outcome"]) for g in fleet.agents[-1].events("kv_gap"))
    assert {shard for shard, _ in gaps} == {e.shard_id for e in engines}, gaps
    assert {outcome for _, outcome in gaps} == {"filled"}, gaps

    # The agent dies (SIGKILL: nothing handed over) while the engines keep publishing; the
    # restarted agent adopts them and forward-fills from replay, with no new batch to help.
    fleet.agents[-1].kill9()
    for e in engines:
        e.publish(*e.burst(4))
    agent = fleet.start_agent()
    deadline = time.monotonic() + 20
    for e in engines:
        while (complaint := fleet.disagreement(e)) is not None:
            agent.assert_alive()
            assert time.monotonic() < deadline, f"after the agent restart: {e.version}: {complaint}"
            time.sleep(0.05)
    filled = {f["shard"] for f in agent.events("kv_forward_filled")}
    assert filled == {e.shard_id for e in engines}, agent.events("kv_forward_filled")
    assert agent.events("shard_started") == [], "the restarted agent restarted an engine"

    # AllBlocksCleared (vLLM's reset_prefix_cache): everything before it is gone.
    for e in engines:
        e.publish(*e.burst(2), [{"type": "AllBlocksCleared"}], [e.stores(2)])
        assert len(e.blocks) == 2
    fleet.agree(engines, "after AllBlocksCleared")

    # Suspend (the profiles run with --enable-sleep-mode): the agent puts each engine to sleep
    # with vLLM's own call, the sleep's AllBlocksCleared empties the index, and the process is
    # kept; resume wakes the same process.
    pids = {e.shard_id: _shard_row(fleet, e.shard_id)[0] for e in engines}
    for version in fleet.sources:
        fleet.cp.admin.post(f"/deployments/{_deployment(version)}/suspend").raise_for_status()
    for e in engines:
        wait_for(
            lambda e=e: e.control_calls() == ["/sleep?level=1&mode=wait"],
            timeout_s=20,
            what=f"vLLM {e.version} put to sleep",
        )
        e.blocks.clear()
        wait_for(
            lambda e=e: "suspended" in _shard_row(fleet, e.shard_id)[2],
            timeout_s=20,
            what=f"vLLM {e.version}'s shard reported suspended",
        )
    fleet.agree(engines, "after the sleep")
    for version in fleet.sources:
        fleet.cp.admin.post(f"/deployments/{_deployment(version)}/resume").raise_for_status()
    for e in engines:
        wait_for(
            lambda e=e: e.control_calls() == ["/sleep?level=1&mode=wait", "/wake_up"],
            timeout_s=20,
            what=f"vLLM {e.version} woken",
        )
        wait_for(
            lambda e=e: _shard_row(fleet, e.shard_id)[1:] == ("ready", ""),
            timeout_s=20,
            what=f"vLLM {e.version}'s shard ready again",
        )
        assert _shard_row(fleet, e.shard_id)[0] == pids[e.shard_id], "the engine was restarted"
    assert agent.events("shard_started") == [], "a suspend or resume restarted an engine"


def _shard_row(fleet: Fleet, shard_id: str) -> tuple[Any, ...]:
    """pid, observed state, observed reason."""
    return fleet.cp.sql(
        "SELECT pid, observed_state, observed_reason FROM shards WHERE id = %s", (shard_id,)
    )[0]
