"""What the router weighs for one request besides load (``router.Inputs``), assembled from what
this gateway knows of prompts; ``router.decide``, beside it, decides from it.

- Shares: per candidate replica, how much of the prompt's prefix it holds. The approximate
  tree's (``ApproxTree``: what this gateway sent where, by chunks of characters) and, for a
  tokenized prompt, the KV index's (``index_shares``) for the replicas whose view is complete.
- Claims: a prompt one of this gateway's requests is computing on a replica (``Claim``, kept
  in the gateway's ``computing`` tree from the send until shortly after the first token). KV
  events reach the index only after the blocks are computed, through the agent's relay, and
  the next turn of a chat may come sooner: until then the claim says where the blocks are, so
  an index share is raised to the claim's.
- The home (``router.home_key``, ``router.token_home_key``) and the hot share
  (``router.hot_share``); the session a request names.
- Once decided: what of the prompt the chosen replica computes (``Routed``).
- Restarts: which replicas' engines changed since the last route table (``RestartWatch``); a
  new engine process has an empty cache, so the trees' claims on it are forgotten.

What it must NOT do: I/O, read clocks or draw random numbers (time, the tokens and the
candidates are passed in), or import anything of the control plane but its pure siblings
(``router``, ``approx``) and ``llmgw.kv``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llmgw.gateway.routing.approx import ApproxTree
from llmgw.gateway.routing.router import (
    NO_PREFIX,
    Candidate,
    Decision,
    HashParams,
    Inputs,
    home_key,
    hot_share,
    precise_shares,
    token_home_key,
)
from llmgw.kv import PrefixIndex

__all__ = [
    "INDEX_POLICIES",
    "NO_PREFIX",
    "TREE_POLICIES",
    "Claim",
    "KvView",
    "RestartWatch",
    "Routed",
    "RoutedEndpoint",
    "block_size",
    "claim_of",
    "claims_tree",
    "index_shares",
    "prefix_inputs",
    "routed",
    "session_of",
    "tree_key",
]

# The policies that consult the tree: the precise policy too, the tree is its fallback.
TREE_POLICIES = ("auto", "approximate", "precise")
# The policies that tokenize a prompt and score it against the KV index.
INDEX_POLICIES = ("auto", "precise")

# (tree key, chunk names) of a prompt whose prefill a replica is computing for this gateway.
Claim = tuple[str, list[int]]
# KV events reach the index within about this long after an engine computed the blocks (the
# agent relays them as they come): a claim outlives the prefill by as much.
_INDEX_LAG_S = 2.0
# Prompts being computed, all models together: in-flight requests' chunks, a few per request.
_CLAIMS_MAX_ENTRIES = 50_000


class KvView(Protocol):
    """The KV index as the router reads it: the index, and whether a shard's view is complete
    (a full copy of the shard's blocks arrived; the agent API's ``ShardViews`` is one)."""

    @property
    def index(self) -> PrefixIndex: ...
    def is_complete(self, shard_id: str) -> bool: ...


class RoutedEndpoint(Protocol):
    """A replica as routing reads it (``routes.Endpoint`` is one)."""

    @property
    def replica(self) -> str: ...
    @property
    def shard(self) -> str: ...
    @property
    def index_model(self) -> str: ...
    @property
    def hash(self) -> HashParams | None: ...
    @property
    def incarnation(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Routed:
    """The router's answer for one request."""

    replica: str
    prompt_tokens: int  # tokenized for precise routing, else the estimate from characters
    prefill: float  # what of them the chosen replica computes, as far as the gateway can tell
    claim: Claim | None  # to claim in the gateway's ``computing`` tree while it does


def claims_tree() -> ApproxTree:
    """The tree of claims (the gateway's ``computing``): a prompt is claimed on its replica
    until its first token (at +inf) and for ``_INDEX_LAG_S`` after, what the replica holds
    before the index can say."""
    return ApproxTree(max_entries=_CLAIMS_MAX_ENTRIES, ttl_s=_INDEX_LAG_S, fork_half_life_s=None)


def tree_key(model: str, salt: str | None) -> str:
    """The trees' key for a prompt: its model and cache salt (salted prompts never share)."""
    return f"{model}\0{salt or ''}"


def session_of(header: str | None, body: Mapping[str, Any]) -> str | None:
    """The session a request names: its x-session-id header, else the body's ``user``."""
    return header or (body.get("user") if isinstance(body.get("user"), str) else None)


def block_size(eps: Iterable[RoutedEndpoint]) -> int:
    """The smallest KV block among endpoints that hash KV events (precise routing's unit)."""
    return min(ep.hash.block_size for ep in eps if ep.hash is not None)


def index_shares(
    kv: KvView,
    eps: Sequence[RoutedEndpoint],
    cands: Sequence[Candidate],
    tokens: Sequence[int],
    *,
    salt: str | None,
    lora: tuple[str, str] | None,
) -> dict[str, float]:
    """replica -> share of the prompt's leading KV blocks its shard holds, for the replicas
    the index can score: their view complete, their engine's hashing reproducible here."""
    index = kv.index
    by_replica = {c.replica: c for c in cands}
    groups: dict[tuple[str, HashParams], list[Candidate]] = {}
    # vLLM >= 0.31 ("tagged") hashes a LoRA adapter's path, and an adapter fetched from a
    # URL runs from a node-local file whose path only its agent knows: hashing with the
    # URL would score every replica 0, a precise decision silently wrong. Those replicas
    # are left to the approximate tier.
    unknowable = lora is not None and "://" in lora[1]
    for ep in eps:
        if ep.hash is not None and not (unknowable and ep.hash.extra_key_format == "tagged"):
            groups.setdefault((ep.index_model, ep.hash), []).append(by_replica[ep.replica])

    def complete(shard: str) -> bool:
        return kv.is_complete(shard) and not index.is_partial(shard)

    out: dict[str, float] = {}
    for (index_model, params), members in groups.items():
        out.update(
            precise_shares(
                index,
                index_model,
                tokens,
                {params: members},
                complete=complete,
                cache_salt=salt,
                lora=lora,
            )
        )
    return out


def prefix_inputs(
    kv: KvView | None,
    tree: ApproxTree,
    computing: ApproxTree,
    eps: Sequence[RoutedEndpoint],
    cands: Sequence[Candidate],
    *,
    key: str,
    chunks: list[int] | None,
    approximate: dict[str, float] | None,
    tokens: list[int] | None,
    salt: str | None,
    lora: tuple[str, str] | None,
    now: float,
) -> Inputs:
    """The prefix inputs of a prompt the tree scored (``chunks``, ``approximate``: None when it
    did not) and that was tokenized (``tokens``: None when it was not), ``key`` being its
    ``tree_key``; ``computing`` holds the claims. Its shares, home and hot share only: the
    caller adds the prompt's length, session and draws."""
    precise: dict[str, float] | None = None
    home: str | None = None
    if tokens is not None and kv is not None:
        precise = index_shares(kv, eps, cands, tokens, salt=salt, lora=lora) or None
    if precise is not None and tokens is not None:
        home = token_home_key(tokens, block_size(eps), precise.values())
    if precise is not None and chunks:
        # Until the index hears of them, a replica holds the blocks this gateway sent it,
        # whatever the index says (else a chat's next turn would find only the system
        # prompt, held everywhere).
        claimed = computing.score(key, chunks, [c.replica for c in cands], now=now)
        precise = {r: max(v, claimed.get(r, 0.0)) for r, v in precise.items()}
    if home is None and chunks and approximate is not None:
        home = home_key(chunks, approximate.values())
    hot = 0.0
    if chunks and approximate is not None:
        # Each candidate as decide() scores it: precisely where it can, else by the tree.
        view = approximate if precise is None else {**approximate, **precise}
        forks = tree.fork_shares(key, chunks, now=now)
        hot = hot_share(forks, len(chunks), view.values())
    return Inputs(precise=precise, approximate=approximate, home=home, hot=hot)


def claim_of(
    policy: str, eps: Iterable[RoutedEndpoint], key: str, chunks: list[int] | None
) -> Claim | None:
    """The claim a request takes on the replica it is sent to: only where a later request may
    be scored precisely (the claim stands in for the index until the blocks' events arrive);
    elsewhere it would be work for nothing."""
    if chunks and policy in INDEX_POLICIES and any(ep.hash is not None for ep in eps):
        return (key, chunks)
    return None


def routed(decision: Decision, inputs: Inputs, prompt_tokens: int, claim: Claim | None) -> Routed:
    """The decision, with what of the prompt the replica computes: all of it but what the
    replica holds as far as this gateway can tell, its KV view (or a prefill of ours in flight
    there) where it was scored precisely. A decision the tree made because the index shows no
    holder is a miss on the index's word, and its prefill is counted whole, or the replica
    looks idle while it computes."""
    held = decision.share
    precise = inputs.precise
    if precise is not None and decision.replica in precise:
        held = precise[decision.replica]
    return Routed(decision.replica, prompt_tokens, (1.0 - held) * prompt_tokens, claim)


class RestartWatch:
    """Which replicas' engine processes changed (``Endpoint.incarnation``) between the route
    tables it is shown. Replicas out of a table (restarting, draining) keep their last process,
    to be compared when they return; past ``max_replicas`` remembered, only the latest table's
    are kept."""

    def __init__(self, max_replicas: int = 100_000) -> None:
        self._max_replicas = max_replicas
        self._seen: dict[str, str] = {}  # replica -> the engine process behind it when last seen

    def restarted(self, endpoints: Iterable[RoutedEndpoint]) -> list[str]:
        """The replicas of ``endpoints`` (a table's, every route's) whose process is not the
        one last seen, once per route that lists them."""
        seen = self._seen
        current: dict[str, str] = {}
        out: list[str] = []
        for ep in endpoints:
            current[ep.replica] = ep.incarnation
            was = seen.get(ep.replica)
            if was and ep.incarnation and was != ep.incarnation:
                out.append(ep.replica)
        if len(seen) + len(current) > self._max_replicas:
            seen.clear()
        seen.update(current)
        return out
