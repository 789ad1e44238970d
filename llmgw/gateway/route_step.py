"""The request's route step: what the pure ``router.decide`` weighs, assembled from this
gateway's state, the decision taken, counted and remembered.

For one request, among the candidates that can take it now: each replica's load and work
(``LoadTracker``); the approximate tree's shares, scored before tokenizing (the tree as it
stood when the request came); the prompt's token ids (``tokens``) scored against the KV index
with the claims of prompts in flight (``routing.inputs.prefix_inputs``); its home, hot share
and session. ``decide`` chooses by the gateway's ``Rule``; the decision is counted
(``llmgw_prefix_decisions_total``, the matched share), recorded in the tree, and returned as a
``Routed``: the replica, the prompt's length, what of it the replica computes and the claim to
take there while it does.

What it must NOT do: send anything (``upstream`` does), or decide itself (``router`` does).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmgw.config import GatewaySettings
from llmgw.gateway.load import LoadTracker
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routes import Endpoint, ModelRoute
from llmgw.gateway.routing.approx import ApproxTree
from llmgw.gateway.routing.inputs import (
    INDEX_POLICIES,
    NO_PREFIX,
    TREE_POLICIES,
    KvView,
    Routed,
    claim_of,
    prefix_inputs,
    routed,
    tree_key,
)
from llmgw.gateway.routing.router import Candidate, Inputs, Rule, decide
from llmgw.gateway.tokens import Tokens
from llmgw.gateway.wire import Prompt

__all__ = ["RouteStep"]


class RouteStep:
    """``tree``: what this gateway sent where (the approximate tier); ``computing``: the
    claims of prompts its requests are computing; ``intake``: the KV index (None: no precise
    routing)."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        load: LoadTracker,
        tree: ApproxTree,
        computing: ApproxTree,
        intake: KvView | None,
        tokens: Tokens,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        s = settings
        self.rule = Rule(s.routing_policy, s.load_slack, s.recompute_weight, s.affinity_tokens)
        self._load = load
        self._tree = tree
        self._computing = computing
        self._intake = intake
        self._tokens = tokens
        self._metrics = metrics
        self._clock = clock
        self._rotation = 0
        self._random = random.Random()

    async def route(
        self,
        route: ModelRoute,
        eps: Sequence[Endpoint],
        body: Mapping[str, Any],
        prompt: Prompt,
        *,
        chat: bool,
        salt: str | None,
        session: str | None,
        estimate: int,
        by_prefix: bool = True,
    ) -> Routed:
        """The replica among ``eps`` for the request, and what of its prompt it computes.
        ``salt``: its cache salt (salted prompts share nothing); ``session``: the session it
        names; ``estimate``: the prompt's length in tokens from its characters; ``by_prefix``:
        False for a request no cache serves (pooling, counting, a pinned follow-up), chosen by
        load alone."""
        policy = self.rule.policy
        load = self._load
        cands = [
            Candidate(ep.replica, ep.shard, load.load(ep.replica), load.work(ep.replica))
            for ep in eps
        ]
        self._rotation += 1
        now = self._clock()
        key = tree_key(route.name, salt)
        chunks: list[int] | None = None
        approx: dict[str, float] | None = None
        tokens: list[int] | None = None
        # Scored before tokenizing: the tree as it stood when the request came.
        if by_prefix and policy in TREE_POLICIES and prompt.text:
            chunks = self._tree.chunks(prompt.text)
            approx = self._tree.score(key, chunks, [c.replica for c in cands], now=now)
        if by_prefix and policy in INDEX_POLICIES and not prompt.multimodal and prompt.text:
            tokens = await self._tokens.ids(route, eps, body, prompt, chat)
        prefix = NO_PREFIX
        if chunks is not None or tokens is not None:
            prefix = prefix_inputs(
                self._intake,
                self._tree,
                self._computing,
                eps,
                cands,
                key=key,
                chunks=chunks,
                approximate=approx,
                tokens=tokens,
                salt=salt,
                lora=route.lora,
                now=now,
            )
        prompt_tokens = len(tokens) if tokens is not None else estimate
        inputs = Inputs(
            precise=prefix.precise,
            approximate=prefix.approximate,
            prompt_tokens=prompt_tokens,
            home=prefix.home,
            hot=prefix.hot,
            session=session,
            rotation=self._rotation,
            pick=self._random.random(),
        )
        decision = decide(cands, self.rule, inputs)
        metrics = self._metrics
        metrics.inc(metrics.decisions, route.name, decision.method, decision.outcome)
        if decision.method in ("precise", "approximate"):
            metrics.observe(metrics.matched_share, decision.share, route.name, decision.method)
        if chunks:
            self._tree.record(key, chunks, decision.replica, now=now)
        return routed(decision, inputs, prompt_tokens, claim_of(policy, eps, key, chunks))
