"""An offline yardstick for time to first token: a run's requests replayed through the
simulator's own scheduler and step cost model (pure: stepped without sleeping), one scheduler
per replica, under an assignment of requests to replicas.

Two assignments:

- ``random``: each request to a replica drawn at random, to check the model against the
  measured random run (same engine rules, no network, no gateway);
- ``clairvoyant``: each request, in arrival order, to the replica where its first token would
  come soonest, found by trying it on a copy of every replica's exact state (queue, batch,
  prefix cache). It knows what no router can (the engines' exact state, every step's cost) and
  is greedy: it never gives up a request's TTFT for a later hit, so a patient router could
  beat it on hit rate, rarely on the tail. What it says is how low TTFT p90 goes when every
  request is placed as well as it can be on arrival, on this trace at this load: a ratio to
  random far from the issue's target there means the target is a question of load, not of
  routing.

Used by bench/routing.py (``oracle.clairvoyant_*`` per run). Seconds per run: a copy of each
replica's scheduler per request.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from llmgw.kv.hashing import BlockHash
from llmgw.simengine.scheduler import RequestSpec, Scheduler, SchedulerConfig
from llmgw.simengine.timing import TimingModel

__all__ = ["Arrival", "Replayed", "replay"]


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the start of the trace
    prompt: tuple[int, ...]  # token ids, as the simulator tokenizes the request
    output_tokens: int  # what the engine generated for it in the measured run


def _hasher(parent: BlockHash | None, tokens: tuple[int, ...], index: int) -> BlockHash:
    # Only equality matters offline: a chained name per block, as the engine chains.
    return BlockHash(hash((parent, tokens)).to_bytes(8, "big", signed=True))


@dataclass(slots=True)
class _Replica:
    sched: Scheduler
    now: float = 0.0  # when its current step ends (or since when it idles)
    first: dict[str, float] = field(default_factory=dict)  # request -> its first token
    cached: dict[str, int] = field(default_factory=dict)  # request -> prefix hit, in tokens

    def step(self, timing: TimingModel) -> None:
        result = self.sched.step()
        self.now += timing.step_duration_s(result.num_prefill_tokens, result.num_decode_seqs)
        for rid in result.emitted:
            self.first.setdefault(rid, self.now)
        for rid, hit in result.admitted:
            self.cached.setdefault(rid, hit)
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


@dataclass(frozen=True, slots=True)
class Replayed:
    ttft_s: list[float]  # per request, in arrival order
    hit_rate: float  # cached prompt tokens / prompt tokens, as the engines counted them


def replay(
    arrivals: Sequence[Arrival],
    *,
    replicas: int,
    config: SchedulerConfig,
    timing: TimingModel,
    assign: Literal["random", "clairvoyant"],
    seed: int = 0,
) -> Replayed:
    """Each request's TTFT (``arrivals`` must be in time order) and the hit rate."""
    fleet = [_Replica(Scheduler(config)) for _ in range(replicas)]
    rng = random.Random(seed)
    ids: list[str] = []
    homes: list[_Replica] = []
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
        else:
            best = None
            for rep in fleet:
                trial = copy.deepcopy(rep)
                trial.sched.add_request(spec)
                ttft = trial.first_token(rid, timing)
                if best is None or ttft < best[0]:
                    best = (ttft, rep)
            assert best is not None
            chosen = best[1]
        chosen.sched.add_request(spec)
        ids.append(rid)
        homes.append(chosen)
    ttfts = [
        rep.first_token(rid, timing) - a.at
        for rid, rep, a in zip(ids, homes, arrivals, strict=True)
    ]
    cached = sum(rep.cached.get(rid, 0) for rid, rep in zip(ids, homes, strict=True))
    prompt = sum(len(a.prompt) for a in arrivals)
    return Replayed(ttfts, cached / prompt if prompt else 0.0)
