"""The router's pure core: which replica of a model serves a request (docs/architecture.md §7).

Inputs are plain values: the candidates (ready, non-draining replicas of the model, each with
its load), the gateway's ``Rule`` (the policy and its weights, from its settings) and the
request's ``Inputs`` (the prompt's precise shares, from ``precise_shares`` over ``llmgw.kv``,
and/or its approximate shares, from ``ApproxTree``; its length, home, hot share, session and
the tie-break draws). Output is a ``Decision``: the replica, the method that decided and the
outcome, for ``llmgw_prefix_decisions_total{model,method,outcome}``.

The load rule (every prefix tier) weighs waiting against recomputing, in prompt tokens. A
candidate's *work* is the prefill still queued on it (this gateway's requests that have not had
their first token, each at the part of its prompt the engine had to compute, plus what other
gateways sent, estimated from the engine's request count); a request sent there waits for that,
then computes the part of its own prompt the replica does not hold. The cost of a candidate is
``work + (1 - share) * prompt_tokens * recompute_weight``, and the cheapest wins unless the
request's home is within reach (below); ties go to the longer share, the lower load, then
rotation. So a hit never waits behind more prefill than recomputing the prompt elsewhere would
cost, and a miss goes where the least prefill is queued, not merely the fewest requests: a
request count treats a 40-token hit and a 2,000-token miss alike. At ``recompute_weight`` 1
each request goes where its first token comes soonest by this estimate; above 1 a prefix stays
on its holders longer, because a copy elsewhere evicts other prompts: a higher hit rate for
about the same tail (bench/routing.py). The weight applies to precise decisions only: an
approximate share is the tree's claim, which may be long evicted, and is weighed at 1. A guard
in requests remains: only replicas whose load (running + waiting + this gateway's in-flight) is
within ``load_slack`` of the least-loaded's are eligible (a replica full of long decodes has no
queued prefill but no free slot either). When a holder of the longest share is passed over the
outcome is ``overloaded`` (counted: a fleet that is too small shows up there).

Homes: the cheapest alone is myopic about caches. Chats that share a system prompt all find
it on the one replica that computed it first, recomputing it elsewhere always costs more than
waiting for nothing, so every new chat piles onto that replica until its cache evicts them
(bench/routing.py, multi-turn: one replica of four served 45% of requests, hit rate 0.64-0.70
against an oracle of 0.76). So each request has a *home*, by rendezvous hashing of its
session (``user``/x-session-id, else ``home_key``: its first KV block or chunk past the
prefix it shares with others, i.e. the chat's first question), and among the replicas costing
at most ``affinity_tokens`` more than the cheapest it goes home. Homes spread sessions over
the replicas like the oracle's partition, two gateways agree on them without talking, and the
bound keeps a holder of a long prefix from being passed over for a home that would recompute
it. A prompt nobody holds has no home: it goes where its prefill starts soonest.

Hot prefixes: the recompute weight is right for a prefix one group of sessions uses (a copy
elsewhere evicts other groups' prompts) and wrong for one every chat opens with (a copy on each
replica serves everyone). With an 800-token system prompt, recomputing it at weight 3 costs
2,400 against its holder, past any home, so every new chat piled onto the first holder
(bench/routing.py --chat-system-tokens 800: precise TTFT p90 475 ms against random's 301). So
a prefix whose share of the traffic (``hot_share``, from the tree's fork counts) deserves more
copies than it has costs nothing to recompute in the comparison: sessions take it to their
homes until enough replicas hold it, while a group's prompt (a sixteenth of the traffic over
four replicas) stays with its holder.

Precise scoring: replicas whose view is complete (``complete`` below: a full copy arrived and
the view is not partial) are scored from the KV index; the others by the approximate tree. A
decision counts as ``precise`` only when at least one candidate was scored precisely, so until
a model's index is warm after a restart its decisions are counted as approximate, never as
precise and silently wrong.

What this module must NOT do: I/O, clocks, randomness of its own (the caller passes
``rotation`` and ``pick``), or import anything of the control plane but its pure siblings.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from llmgw.kv import DEVICE_MEDIUM, PrefixIndex, block_hashes, hash64, scorable_blocks
from llmgw.kv.hashing import ExtraKeyFormat

__all__ = [
    "NO_PREFIX",
    "Candidate",
    "Decision",
    "HashParams",
    "Inputs",
    "Method",
    "Outcome",
    "Policy",
    "Rule",
    "decide",
    "home_key",
    "hot_share",
    "precise_shares",
    "token_home_key",
]

Policy = Literal["auto", "precise", "approximate", "least_loaded", "round_robin", "random"]
Method = Literal["precise", "approximate", "least_loaded", "round_robin", "random"]
# hit: routed to the replica holding the longest prefix; miss: nobody holds any of it;
# overloaded: a holder was passed over for load; none: the policy does not look at prefixes.
Outcome = Literal["hit", "miss", "overloaded", "none"]
# The media a precise hit is scored on (the index keeps offload tiers apart).
_DEVICE = (DEVICE_MEDIUM,)


@dataclass(frozen=True, slots=True)
class HashParams:
    """How a replica's engine hashes KV blocks (the profile's kv_hash): replicas that agree
    share one hashing pass per prompt."""

    seed: str | None
    block_size: int
    extra_key_format: ExtraKeyFormat


@dataclass(frozen=True, slots=True)
class Candidate:
    replica: str
    shard: str  # the rank-0 shard: its KV view's name in the index
    load: int  # running + waiting (engine) + this gateway's in-flight
    work: float = 0.0  # prompt tokens queued for prefill ahead of a new request (estimated)


@dataclass(frozen=True, slots=True)
class Rule:
    """How this gateway decides, the same for every request (its settings): the policy, the
    request guard ``load_slack``, the weight of recomputing a precisely held prefix, and how
    much more cost, in prompt tokens, a request accepts to land on its home (0: off)."""

    policy: Policy
    load_slack: int = 8
    recompute_weight: float = 3.0
    affinity_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Inputs:
    """What one request brings to ``decide`` besides the candidates.

    ``precise``: replica -> share, for replicas scored from a complete KV view (None: precise
    was not attempted). ``approximate``: replica -> share from the approximate tree (None: not
    consulted). ``prompt_tokens``: the prompt's length (tokenized or estimated), what a miss
    costs to compute; 0 leaves the share alone to decide among eligible replicas of equal
    work. ``home``: the request's name for its home when it has no session (``home_key``).
    ``hot``: the leading share of the prompt more replicas should hold (``hot_share``):
    recomputing it costs nothing here. ``session``: the session it names. ``rotation``: a
    counter for round-robin and tie rotation; ``pick`` in [0, 1) for the random policy."""

    precise: Mapping[str, float] | None = None
    approximate: Mapping[str, float] | None = None
    prompt_tokens: int = 0
    home: str | None = None
    hot: float = 0.0
    session: str | None = None
    rotation: int = 0
    pick: float = 0.0


# A request whose policy does not look at prefixes, or whose prompt gave the tiers nothing.
NO_PREFIX = Inputs()


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    method: Method
    outcome: Outcome
    share: float  # of the chosen replica's prompt prefix held (0.0 for non-prefix policies)


def _affinity(session: str, replica: str) -> int:
    # Rendezvous hashing: a session keeps its replica while the candidate set allows, and
    # losing one replica moves only that replica's sessions. blake2b, not hash(): two gateway
    # processes must agree.
    digest = hashlib.blake2b(f"{session}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _home_unit(units: int, shares: Collection[float]) -> int | None:
    """Which unit of a prompt of ``units`` names its session: the first past the prefix it
    shares with others (what the replicas holding least of it, but some, hold), in the units
    ``shares`` count, so the position is exact and every turn of a chat gets one name. A
    group's prompt nobody holds is named by its first unit; a chat whose system prompt some
    replica holds, by its own first unit past it (one more unit of margin: the unit where they
    part may still hold only the template's tokens, alike in every chat)."""
    if units <= 0:
        return None
    common = min((v for v in shares if v > 0.0), default=0.0)
    start = round(common * units) + 1 if common > 0.0 else 0
    return min(units - 1, start)


def home_key(chunks: Sequence[int], shares: Collection[float]) -> str | None:
    """The session's name when none is given, from the approximate tier: the chained chunk
    (``ApproxTree.chunks``) that ``_home_unit`` picks, ``shares`` being the tree's."""
    unit = _home_unit(len(chunks), shares)
    return None if unit is None else str(chunks[unit])


def token_home_key(
    token_ids: Sequence[int], block_size: int, shares: Collection[float]
) -> str | None:
    """The same from precise shares (whole scorable KV blocks): a hash of the tokens up to the
    end of the block ``_home_unit`` picks, the one prefix that names the session (one pass
    over those tokens, in C; not the engine's block hash, only a name)."""
    unit = _home_unit(scorable_blocks(len(token_ids), block_size), shares)
    if unit is None:
        return None
    try:
        prefix = array("q", token_ids[: (unit + 1) * block_size]).tobytes()
    except OverflowError:
        # An id past 64 bits: the gateway refuses those in a prompt (wire.MAX_TOKEN_ID), so
        # only a replica's /tokenize could hand one over; such a prompt has no home.
        return None
    return hashlib.blake2b(prefix, digest_size=8).hexdigest()


def hot_share(forks: Sequence[float], units: int, shares: Collection[float]) -> float:
    """The leading share of a prompt of ``units`` chunks that more replicas should hold than
    do: the deepest prefix after which a share f of recent prompts parted (``forks``: per
    leading chunk, from ``ApproxTree.fork_shares``) held by fewer than f x n of the n
    candidates (``shares``: theirs of this prompt). A share f of the traffic is worth f x n
    replicas' time, so as many copies of what it shares. 0.0: nothing is."""
    n = len(shares)
    if units <= 0 or n < 2:
        return 0.0
    for depth in range(min(len(forks), units) - 1, -1, -1):
        f = forks[depth]
        if f * n <= 1.0:
            continue  # one copy carries it (and a prefix everyone parts from has one)
        # A replica holds the prefix if its share reaches the chunk before the fork: shares
        # counted in KV blocks and chunks of characters disagree by a unit or so.
        held = depth / units
        holders = sum(1 for s in shares if s > 0.0 and s >= held)
        if f * n > holders:
            return (depth + 1) / units
    return 0.0


def _tie_break(tied: Sequence[Candidate], session: str | None, rotation: int) -> Candidate:
    if len(tied) == 1:
        return tied[0]
    if session:
        return max(tied, key=lambda c: _affinity(session, c.replica))
    ordered = sorted(tied, key=lambda c: c.replica)
    return ordered[rotation % len(ordered)]


def _least_loaded(cands: Sequence[Candidate], session: str | None, rotation: int) -> Candidate:
    low = min(c.load for c in cands)
    return _tie_break([c for c in cands if c.load == low], session, rotation)


def decide(candidates: Sequence[Candidate], rule: Rule, inputs: Inputs = NO_PREFIX) -> Decision:
    """Choose among ``candidates`` (non-empty) by ``rule``, weighing the request's ``inputs``."""
    if not candidates:
        raise ValueError("decide needs at least one candidate")
    policy = rule.policy
    precise, approximate = inputs.precise, inputs.approximate
    session, rotation = inputs.session, inputs.rotation
    if policy == "round_robin":
        ordered = sorted(candidates, key=lambda c: c.replica)
        return Decision(ordered[rotation % len(ordered)].replica, "round_robin", "none", 0.0)
    if policy == "random":
        index = min(len(candidates) - 1, int(inputs.pick * len(candidates)))
        return Decision(candidates[index].replica, "random", "none", 0.0)
    if policy == "least_loaded" or (precise is None and approximate is None):
        chosen = _least_loaded(candidates, session, rotation)
        return Decision(chosen.replica, "least_loaded", "none", 0.0)

    shares: dict[str, float] = {}
    scored_precisely = False
    for c in candidates:
        if precise is not None and c.replica in precise:
            shares[c.replica] = precise[c.replica]
            scored_precisely = True
        elif approximate is not None:
            shares[c.replica] = approximate.get(c.replica, 0.0)
        else:
            shares[c.replica] = 0.0
    method: Method = "precise" if scored_precisely else "approximate"
    best_any = max(shares.values())
    if (
        best_any <= 0.0
        and scored_precisely
        and approximate
        and any(approximate.get(c.replica, 0.0) > 0.0 for c in candidates)
    ):
        # No replica holds a block yet: most often the prefix is still in its first prefill
        # somewhere (KV events come after the blocks are computed). What this gateway sent
        # where knows that; scattering the followers would compute the prefix again.
        shares = {c.replica: approximate.get(c.replica, 0.0) for c in candidates}
        method = "approximate"
        best_any = max(shares.values())
    low = min(c.load for c in candidates)
    eligible = [c for c in candidates if c.load <= low + rule.load_slack]
    # Only what the KV index shows is worth waiting for beyond the break-even: the tree's
    # claims may be long evicted, and holding to them queues whole prefills on one replica.
    weight = rule.recompute_weight if method == "precise" else 1.0
    recompute = inputs.prompt_tokens * weight
    hot = inputs.hot

    def cost(c: Candidate) -> float:
        return c.work + (1.0 - max(shares[c.replica], hot)) * recompute

    cheapest = min(cost(c) for c in eligible)
    tied = [c for c in eligible if cost(c) == cheapest]
    share = max(shares[c.replica] for c in tied)
    tied = [c for c in tied if shares[c.replica] == share]
    key = session or inputs.home
    affinity_tokens = rule.affinity_tokens
    # A prompt nobody holds has no cache to share or protect: its prefill goes where it
    # starts soonest (a home would only queue it).
    if key is not None and affinity_tokens > 0.0 and best_any > 0.0:
        # A session stays on its home while that costs at most affinity_tokens more than
        # the cheapest: homes spread sessions over the replicas (rendezvous hashing) and two
        # gateways agree on them, where the cheapest alone piles every new chat onto the
        # one replica holding the system prompt they share, whose cache then evicts them.
        peers = [c for c in eligible if cost(c) <= cheapest + affinity_tokens]
        chosen = max(peers, key=lambda c: _affinity(key, c.replica))
    else:
        chosen = _least_loaded(tied, session, rotation)
    share = shares[chosen.replica]
    if best_any <= 0.0:
        return Decision(chosen.replica, method, "miss", 0.0)
    outcome: Outcome = "hit" if share >= best_any else "overloaded"
    return Decision(chosen.replica, method, outcome, share)


def precise_shares(
    index: PrefixIndex,
    index_model: str,
    token_ids: Sequence[int],
    groups: Mapping[HashParams, Collection[Candidate]],
    *,
    complete: Callable[[str], bool],
    cache_salt: str | None,
    lora: tuple[str, str] | None = None,
) -> dict[str, float]:
    """replica -> share of the prompt's scorable leading blocks its shard holds, for every
    candidate whose view is complete (``complete(shard)``; partial views are left out, so the
    caller scores them by the approximate tier).

    The prompt is hashed once per hash-parameter group, with the cache salt and LoRA adapter
    as extra keys exactly as the engine hashes them; the last block is never scored when the
    prompt length is a multiple of the block size (vLLM cannot hit it).
    """
    out: dict[str, float] = {}
    lora_name, lora_path = lora if lora is not None else (None, None)
    for params, members in groups.items():
        scored = [c for c in members if complete(c.shard)]
        if not scored:
            continue
        n = scorable_blocks(len(token_ids), params.block_size)
        if n == 0:
            for c in scored:
                out[c.replica] = 0.0
            continue
        digests = block_hashes(
            token_ids[: n * params.block_size],
            params.block_size,
            seed=params.seed,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            extra_key_format=params.extra_key_format,
        )
        hashes = [hash64(d) for d in digests[:n]]
        # Device blocks only: a block vLLM offloaded to host memory or storage must be loaded
        # back before it saves any prefill, so it is no hit to route by (issue 35).
        scores = index.score(index_model, hashes, [c.shard for c in scored], media=_DEVICE)
        for c in scored:
            s = scores[c.shard]
            if s.partial:
                continue  # the approximate tier scores it
            out[c.replica] = s.share
    return out
