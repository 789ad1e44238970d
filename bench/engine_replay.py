"""An offline yardstick for time to first token: a run's requests replayed through the
simulator's own scheduler and step cost model (pure: stepped without sleeping), one scheduler
per replica, under an assignment of requests to replicas.

Three assignments:

- ``random``: each request to a replica drawn at random, to check the model against the
  measured random run (same engine rules, no network, no gateway);
- ``clairvoyant``: each request, in arrival order, to the replica where its first token would
  come soonest, found by trying it on a copy of every replica's exact state (queue, batch,
  prefix cache). It knows what no router can (the engines' exact state, every step's cost) and
  is greedy: it never gives up a request's TTFT for a later hit, so a patient router could
  beat it on hit rate, rarely on the tail. What it says is how low TTFT p90 goes when every
  request is placed as well as it can be on arrival, on this trace at this load: a ratio to
  random far from the routing target there (precise's TTFT p90 a fifth of random's,
  bench/routing.py) means the target is a question of load, not of routing;
- ``router``: llmgw's own rule (``router.decide`` with homes, and ``LoadTracker`` for load and
  work), one tracker per gateway of the trace, each knowing its own requests' prefill until
  their first token and the others' only through a scrape of the engines' request counts
  every ``load_scrape_s``, as the running gateways do; precise shares read from the engines'
  exact caches (no index lag, no tokenize call, no network). Its p90 against the measured
  precise run's says what the system loses outside the rule; against the clairvoyant's, what
  the rule and the gateways' view of the load lose.

Used by bench/routing.py (``oracle.<assignment>_replayed_*`` per run). Seconds per run: a copy of each
replica's scheduler per request.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from llmgw.config import GatewaySettings
from llmgw.gateway.load import LoadTracker
from llmgw.gateway.routing.router import Candidate, Inputs, Rule, decide, token_home_key
from llmgw.kv import scorable_blocks
from llmgw.kv.hashing import BlockHash
from llmgw.simengine.scheduler import RequestSpec, Scheduler, SchedulerConfig
from llmgw.simengine.timing import TimingModel

__all__ = ["Arrival", "Replayed", "replay"]


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the start of the trace
    prompt: tuple[int, ...]  # token ids, as the simulator tokenizes the request
    output_tokens: int  # what the engine generated for it in the measured run
    gateway: int = 0  # which gateway the client sent it to


def _hasher(parent: BlockHash | None, tokens: tuple[int, ...], index: int) -> BlockHash:
    # Only equality matters offline: a chained name per block, as the engine chains.
    return BlockHash(hash((parent, tokens)).to_bytes(8, "big", signed=True))


@dataclass(slots=True)
class _Replica:
    sched: Scheduler
    now: float = 0.0  # when its current step ends (or since when it idles)
    first: dict[str, float] = field(default_factory=dict)  # request -> its first token
    cached: dict[str, int] = field(default_factory=dict)  # request -> prefix hit, in tokens
    done: dict[str, float] = field(default_factory=dict)  # request -> when it finished

    def step(self, timing: TimingModel) -> None:
        result = self.sched.step()
        self.now += timing.step_duration_s(result.num_prefill_tokens, result.num_decode_seqs)
        for rid in result.emitted:
            self.first.setdefault(rid, self.now)
        for rid, hit in result.admitted:
            self.cached.setdefault(rid, hit)
        for rid in result.finished:
            self.done[rid] = self.now
        self.sched.take_events()  # nobody listens offline; events would pile up

    def advance(self, t: float, timing: TimingModel) -> None:
        """Run every step that starts before ``t`` (a request arriving at ``t`` joins the
        next one, as the engine's loop takes new requests between steps)."""
        while self.sched.has_work() and self.now < t:
            self.step(timing)
        if not self.sched.has_work():
            self.now = max(self.now, t)

    def first_token(self, rid: str, timing: TimingModel) -> float:
        while rid not in self.first:
            self.step(timing)
        return self.first[rid]

    def share(self, prompt: tuple[int, ...], block_size: int) -> float:
        """The prompt's scorable leading blocks this replica's cache holds, as a share (what
        the KV index would say with no lag)."""
        n = scorable_blocks(len(prompt), block_size)
        if n == 0:
            return 0.0
        cached = set(self.sched.cached_block_hashes())
        parent: BlockHash | None = None
        for i in range(n):
            parent = _hasher(parent, prompt[i * block_size : (i + 1) * block_size], i)
            if parent not in cached:
                return i / n
        return 1.0


@dataclass(slots=True)
class _Gateway:
    """One gateway's view: its LoadTracker, fed as the running gateway feeds it."""

    load: LoadTracker
    next_scrape: float  # when it next reads the engines' request counts
    sent: list[tuple[str, int, float]] = field(default_factory=list)  # rid, replica, prefill
    prefilled: set[str] = field(default_factory=set)

    def catch_up(self, fleet: list[_Replica], now: float) -> None:
        """Count off first tokens and ends the gateway has seen by ``now``."""
        still = []
        for rid, k, prefill in self.sent:
            rep = fleet[k]
            if rid not in self.prefilled and rep.first.get(rid, math.inf) <= now:
                self.load.prefilled(f"replica-{k}", prefill)
                self.prefilled.add(rid)
            if rep.done.get(rid, math.inf) <= now:
                self.load.finished(f"replica-{k}")
                self.prefilled.discard(rid)
            else:
                still.append((rid, k, prefill))
        self.sent = still


@dataclass(frozen=True, slots=True)
class Replayed:
    ttft_s: list[float]  # per request, in arrival order
    hit_rate: float  # cached prompt tokens / prompt tokens, as the engines counted them


def _clairvoyant(fleet: list[_Replica], spec: RequestSpec, timing: TimingModel) -> _Replica:
    """The replica where the request's first token comes soonest, tried on a copy of each."""

    def ttft(rep: _Replica) -> float:
        trial = copy.deepcopy(rep)
        trial.sched.add_request(spec)
        return trial.first_token(spec.request_id, timing)

    return min(fleet, key=ttft)


@dataclass(slots=True)
class _Router:
    """llmgw's rule over the gateways' views, as the running control planes apply it."""

    settings: GatewaySettings
    block_size: int
    gateways: list[_Gateway]
    # Per replica: requests sent there (rid, when) that no scrape has yet seen finished.
    live: list[list[tuple[str, float]]]

    def _scrape_until(self, fleet: list[_Replica], t: float) -> None:
        """The scrapes due by ``t``, in time order, each seeing the engines as they were."""
        while (gw := min(self.gateways, key=lambda g: g.next_scrape)).next_scrape <= t:
            at = gw.next_scrape
            gw.catch_up(fleet, at)
            for k, rep in enumerate(fleet):
                # Scrapes come in time order: what ended by one is gone for all later ones.
                live = [(r, sent) for r, sent in self.live[k] if rep.done.get(r, math.inf) > at]
                self.live[k] = live
                gw.load.observed(f"replica-{k}", sum(1 for _, sent in live if sent <= at))
            gw.next_scrape += self.settings.load_scrape_s

    def choose(self, i: int, a: Arrival, rid: str, fleet: list[_Replica]) -> _Replica:
        self._scrape_until(fleet, a.at)
        gw = self.gateways[a.gateway]
        gw.catch_up(fleet, a.at)
        shares = {
            f"replica-{k}": rep.share(a.prompt, self.block_size) for k, rep in enumerate(fleet)
        }
        s = self.settings
        d = decide(
            [Candidate(r, r, gw.load.load(r), gw.load.work(r)) for r in shares],
            Rule("precise", s.load_slack, s.recompute_weight, s.affinity_tokens),
            Inputs(
                precise=shares,
                prompt_tokens=len(a.prompt),
                home=token_home_key(a.prompt, self.block_size, shares.values()),
                rotation=i,
            ),
        )
        k = int(d.replica.rsplit("-", 1)[1])
        prefill = (1.0 - shares[d.replica]) * len(a.prompt)
        gw.load.started(d.replica, prefill)
        gw.sent.append((rid, k, prefill))
        self.live[k].append((rid, a.at))
        return fleet[k]


def replay(
    arrivals: Sequence[Arrival],
    *,
    replicas: int,
    config: SchedulerConfig,
    timing: TimingModel,
    assign: Literal["random", "clairvoyant", "router"],
    seed: int = 0,
    settings: GatewaySettings | None = None,
) -> Replayed:
    """Each request's TTFT (``arrivals`` must be in time order) and the hit rate.
    ``settings``: the gateways' (router mode), defaults if None."""
    fleet = [_Replica(Scheduler(config)) for _ in range(replicas)]
    rng = random.Random(seed)
    s = settings or GatewaySettings()
    count = max((a.gateway for a in arrivals), default=0) + 1
    router = _Router(
        s,
        config.block_size,
        [
            _Gateway(
                LoadTracker(eject_after=1, eject_for_s=1.0, clock=lambda: 0.0),
                # Each gateway scrapes on its own phase, as processes started apart do.
                next_scrape=g * s.load_scrape_s / count,
            )
            for g in range(count)
        ],
        [[] for _ in range(replicas)],
    )
    placed: list[tuple[str, _Replica]] = []
    for i, a in enumerate(arrivals):
        rid = f"r{i}"
        spec = RequestSpec(
            request_id=rid,
            prompt_token_ids=a.prompt,
            output_token_ids=tuple(range(1, max(1, a.output_tokens) + 1)),
            hasher=_hasher,
        )
        for rep in fleet:
            rep.advance(a.at, timing)
        if assign == "random":
            chosen = fleet[rng.randrange(replicas)]
        elif assign == "router":
            chosen = router.choose(i, a, rid, fleet)
        else:
            chosen = _clairvoyant(fleet, spec, timing)
        chosen.sched.add_request(spec)
        placed.append((rid, chosen))
    ttfts = [
        rep.first_token(rid, timing) - a.at for (rid, rep), a in zip(placed, arrivals, strict=True)
    ]
    cached = sum(rep.cached.get(rid, 0) for rid, rep in placed)
    prompt = sum(len(a.prompt) for a in arrivals)
    return Replayed(ttfts, cached / prompt if prompt else 0.0)
