"""Precise routing through the gateway against real simulator processes, with the KV index fed
the blocks each engine reports holding (its /debug/kv_blocks, applied as an agent's full copy),
so each step is deterministic: which replica holds what is set by the test.

Proves: with no complete view the decision is counted approximate (never precise); once views
are complete a request goes to the replica holding its prefix, by a precise decision, and the
engine confirms the hit (cached_tokens); a partial view gets no precise credit; a salted key's
prompt scores nothing against unsalted blocks.
"""

from __future__ import annotations

import array
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from llmgw.config import GatewaySettings
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.gateway.routing.router import HashParams
from llmgw.kv.shard_views import PlacedShard, ShardViews
from llmgw.protocol.kvstream import KvDeltaRequest
from tests.gateway.gateway_testkit import SIM_KEY, Key, Served, serve_gateway
from tests.simengine.sim_process import HASH_SEED, SimProcess, start_sim, stop_sim

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

KEYS = {"s1": Key("k1", "plain"), "s2": Key("k2", "salted", cache_salt="tenant-2")}
PLAIN = {"Authorization": "Bearer llmgw_k1_s1"}
SALTED = {"Authorization": "Bearer llmgw_k2_s2"}
PARAMS = HashParams(seed=HASH_SEED, block_size=16, extra_key_format="tagged")


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimProcess]]:
    tmp = tmp_path_factory.mktemp("sims")
    started = []
    try:
        for _ in range(3):
            started.append(
                start_sim(
                    tmp,
                    *("--served-model-name", "m", "--time-scale", "0.05"),
                    env={"SIMENGINE_API_KEY": SIM_KEY},
                )
            )
        yield started
    finally:
        for sim in started:
            stop_sim(sim)


class World:
    def __init__(self, sims: list[SimProcess]) -> None:
        self.sims = sims
        self.intake = ShardViews()
        self.placed = {f"s{i}": PlacedShard("node", "m", 16) for i in range(len(sims))}
        self.versions = dict.fromkeys(self.placed, 0)

    def table(self) -> RouteTable:
        eps = tuple(
            Endpoint(f"r{i}", f"s{i}", s.base_url, SIM_KEY, "m", PARAMS, {})
            for i, s in enumerate(self.sims)
        )
        return RouteTable({"m": ModelRoute("m", "m", None, eps)}, 1.0)

    def sync(self, *, partial: frozenset[int] = frozenset()) -> None:
        """Each engine's blocks, as the agent's full copy of its mirror would carry them."""
        for i, sim in enumerate(self.sims):
            shard = f"s{i}"
            held = httpx.get(f"{sim.base_url}/debug/kv_blocks", timeout=5).json()
            hashes = array.array("Q", [b["hash"] for b in held["blocks"]])
            self.versions[shard] += 1
            result = self.intake.apply(
                "node",
                KvDeltaRequest(
                    shard_id=shard,
                    base_version=0,
                    new_version=self.versions[shard],
                    reset=True,
                    partial=i in partial,
                    block_size=16,
                    added={"GPU": hashes},
                ),
                self.placed,
            )
            assert result == "ack"


def _direct(sim: SimProcess, prompt: str) -> None:
    r = httpx.post(
        f"{sim.base_url}/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 1},
        headers={"Authorization": f"Bearer {SIM_KEY}"},
        timeout=10,
    )
    assert r.status_code == 200


def _via(gw: Served, prompt: str, headers: dict[str, str] = PLAIN) -> int:
    r = httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 1},
        headers=headers,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _decisions(gw: Served, method: str, outcome: str) -> float:
    registry: CollectorRegistry = gw.registry
    value = registry.get_sample_value(
        "llmgw_prefix_decisions_total", {"model": "m", "method": method, "outcome": outcome}
    )
    return value or 0.0


def _system(tag: str) -> str:
    return " ".join(f"{tag} instruction {i} keeps its words." for i in range(60))


def test_precise_routing_follows_the_index(sims: list[SimProcess]) -> None:
    world = World(sims)
    settings = GatewaySettings(tokenize_timeout_s=2.0)
    with serve_gateway(world.table(), KEYS, settings=settings, intake=world.intake) as gw:
        # Nothing is known yet: counted approximate, never precise.
        _via(gw, _system("cold") + " q")
        assert _decisions(gw, "precise", "hit") + _decisions(gw, "precise", "miss") == 0
        assert _decisions(gw, "approximate", "miss") == 1

        # Each engine gets its own system prompt behind the gateway's back (its tree knows
        # nothing of them); the index learns them as the agents would report them.
        for i, sim in enumerate(sims):
            _direct(sim, _system(f"tenant{i}") + " warmup")
        world.sync()
        # (An order that tie rotation alone would never produce: a hit is the index's doing.)
        for i in (0, 1, 2, 0):
            assert _via(gw, _system(f"tenant{i}") + f" question {i}") >= 16 * 10
        assert _decisions(gw, "precise", "hit") == 4

        # A partial view gets no precise credit: its replica is scored by the tree, which has
        # never seen this prompt, so the decision is a miss (routed least-loaded).
        _direct(sims[1], _system("partial") + " warmup")
        world.sync(partial=frozenset({1}))
        misses = _decisions(gw, "precise", "miss")
        _via(gw, _system("partial") + " question")
        assert _decisions(gw, "precise", "miss") == misses + 1

        # The salted key's prompt is hashed with its salt: unsalted blocks score nothing.
        world.sync()
        misses = _decisions(gw, "precise", "miss")
        assert _via(gw, _system("tenant0") + " salted question", SALTED) == 0
        assert _decisions(gw, "precise", "miss") == misses + 1


def test_a_turn_the_index_has_not_heard_of_yet_follows_what_this_gateway_sent(
    sims: list[SimProcess],
) -> None:
    # Every engine holds the system prompt, and the index knows it. A chat's first turn goes
    # to one of them; its blocks reach the index only when the agent relays them (here: never,
    # the test does not sync again). The next turn, sent at once, must still go where the
    # first went: until the index can say, what this gateway sent is held there.
    world = World(sims)
    system = _system("everyone")
    for sim in sims:
        _direct(sim, system + " warmup")
    world.sync()
    # No homes: the next turn would find the system prompt alike everywhere and rotate.
    settings = GatewaySettings(tokenize_timeout_s=2.0, affinity_tokens=0)
    with serve_gateway(world.table(), KEYS, settings=settings, intake=world.intake) as gw:
        for chat in range(3):
            first = f"{system} chat {chat}: " + " ".join(f"word{k}" for k in range(80))
            system_hit = _via(gw, first)
            assert system_hit >= 16 * 10
            # The first turn's own blocks (80 words: more than two blocks) are hits too.
            cached = _via(gw, first + " and then a second question")
            assert cached >= system_hit + 2 * 16, (chat, system_hit, cached)
        assert _decisions(gw, "precise", "hit") >= 3
