"""A prompt's token ids for precise routing: local or remote, verified, and reported.

Where the ids come from, for a route whose replicas hash KV events (the others are never
tokenized): the request's own ``prompt`` ids; else the model's tokenizer files, in this process
(``local_tokens``: loaded from the files the agents shipped, ``TokenizerSource``), a sample of
them compared afterwards with a replica's ``/tokenize`` off the request path; else, or when
the files are unusable or were caught disagreeing, a replica's ``/tokenize`` itself
(``tokenize``: bounded, the least-loaded replica asked). A prompt shorter than
``precise_min_blocks`` KV blocks is not worth a round trip and is not tokenized; nothing here
ever fails a request: no ids is an answer (the approximate tree routes it).

``llmgw_prefix_tokenizer_mode{model,mode}`` says per served model which of "local", "remote"
or "none" (precise routing does not tokenize it) is in force, reported with the stats and at
once when a verification disables a model's files.

What it must NOT do: raise into the request path, or tokenize a model whose profile says
``tokenizer: none`` in this process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp

from llmgw.config import GatewaySettings
from llmgw.gateway.errors import GatewayError, bad_request
from llmgw.gateway.load import LoadTracker
from llmgw.gateway.local_tokens import MODES, LocalTokenizers, Mode, Verdict
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.gateway.routing.inputs import INDEX_POLICIES, block_size
from llmgw.gateway.tokenize import Tokenizer, tokenize_payload
from llmgw.gateway.wire import Prompt
from llmgw.kv.hf_tokenizer import TokenizerFiles

__all__ = ["CHARS_PER_TOKEN", "TokenizerSource", "Tokens"]

# Characters per token when estimating a prompt's length before it is tokenized: low on
# purpose, so a prompt is rather tokenized once too often than never.
CHARS_PER_TOKEN = 3
# A verification is off the request path: it may wait for a busy replica's /tokenize longer
# than routing would (a sample lost to a timeout is only asked again later).
_VERIFY_TIMEOUT_S = 2.0


class TokenizerSource(Protocol):
    """Each model's tokenizer files (``tokenizer_files.TokenizerFilesCache``, kept current by
    it from Postgres): served model name -> files."""

    @property
    def files(self) -> Mapping[str, TokenizerFiles]: ...


class Tokens:
    """The gateway's tokenizing: ``local`` (the models' files, in process) and the remote
    ``/tokenize`` client (``open`` at start, on the upstream session). ``indexed``: this
    process has a KV index to score ids against (without one nothing is tokenized);
    ``table``: the route table as it stands, for the mode report."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        metrics: GatewayMetrics,
        load: LoadTracker,
        files: TokenizerSource | None,
        indexed: bool,
        table: Callable[[], RouteTable],
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._load = load
        self._files = files
        self._indexed = indexed
        self._table = table
        s = settings
        self.local = LocalTokenizers(
            workers=s.local_tokenize_workers,
            timeout_s=s.local_tokenize_timeout_s,
            max_chars=s.local_tokenize_max_chars,
            verify_first=s.tokenizer_verify_first,
            verify_every=s.tokenizer_verify_every,
        )
        self.local.on_disabled = lambda _model: self.report_modes()
        self._remote: Tokenizer | None = None

    def open(self, http: aiohttp.ClientSession) -> None:
        """Ask replicas' /tokenize over ``http`` (the upstream pool) from now on."""
        s = self._settings
        self._remote = Tokenizer(
            http, timeout_s=s.tokenize_timeout_s, concurrency=s.tokenize_concurrency
        )

    def close(self) -> None:
        self.local.close()

    def sync(self) -> None:
        """Take the models' tokenizer files as the store has them now (loads what changed)."""
        if self._files is not None and self._settings.local_tokenize:
            self.local.sync(self._files.files)

    # --- modes -----------------------------------------------------------------------------

    def mode(self, route: ModelRoute) -> Mode:
        """How precise routing tokenizes the route's prompts: "local", "remote" or "none"."""
        if not self._indexed or self._settings.routing_policy not in INDEX_POLICIES:
            return "none"
        if route.endpoints and not any(ep.hash is not None for ep in route.endpoints):
            return "none"
        if not self._may_tokenize_here(route):
            return "remote"
        return self.local.mode(route.base)

    def report_modes(self) -> None:
        """``llmgw_prefix_tokenizer_mode``: per served model, 1 for how its prompts are
        tokenized, 0 for the other modes."""
        metrics = self._metrics
        for route in self._table().routes.values():
            if route.lora is not None:
                continue
            mode = self.mode(route)
            for m in MODES:
                metrics.gauge(metrics.tokenizer_mode, 1.0 if m == mode else 0.0, route.name, m)
            none = 1.0 if route.tokenizer_none else 0.0
            metrics.gauge(metrics.tokenizer_profile_none, none, route.name)
            failing = self.local.failing(route.base)
            if failing is not None:
                metrics.gauge(metrics.tokenizer_failing, 1.0, route.name, failing)

    def _may_tokenize_here(self, route: ModelRoute) -> bool:
        """Whether the route's prompts may be tokenized here at all: the setting allows it, and
        no profile serving the model says ``tokenizer: none``."""
        return self._settings.local_tokenize and not route.tokenizer_none

    # --- the request's ids -----------------------------------------------------------------

    async def ids(
        self,
        route: ModelRoute,
        eps: Sequence[Endpoint],
        body: Mapping[str, Any],
        prompt: Prompt,
        chat: bool,
    ) -> list[int] | None:
        """The prompt's token ids for precise routing; None where they would not be scored
        (no replica hashes KV events, no index), are not worth asking for (a prompt shorter
        than ``precise_min_blocks`` blocks) or could not be had in time."""
        hashed = [ep for ep in eps if ep.hash is not None]
        if not hashed or not self._indexed:
            return None
        if prompt.token_ids is not None:
            return prompt.token_ids
        block = block_size(hashed)
        if len(prompt.text) < self._settings.precise_min_blocks * block * CHARS_PER_TOKEN:
            return None
        if self._files is not None and self._may_tokenize_here(route):
            local = await self._local(route, hashed, body, prompt, chat)
            if local is not None:
                return self._within_context(route, local, chat)
        remote = await self._ask_replica(route, hashed, body, chat)
        return None if remote is None else self._within_context(route, remote, chat)

    def _within_context(self, route: ModelRoute, ids: list[int], chat: bool) -> list[int]:
        """The ids, or the 400 of a prompt longer than the model's context length (the
        smallest ``max_model_len`` its replicas state): the engine would refuse it too, after
        the queue and the routing it cost."""
        limit = self._load.context_limit(ep.replica for ep in route.endpoints)
        if limit is not None and len(ids) > limit:
            raise bad_request(
                f"the prompt is {len(ids)} tokens, over {route.name!r}'s context length of "
                f"{limit} tokens; send a shorter prompt or fewer messages",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        return ids

    def _too_long(self, chars: int | None, chat: bool) -> GatewayError:
        limit = self.local.max_chars
        what = f"is {chars} characters" if chars is not None else "renders to"
        return bad_request(
            f"the prompt {what} over {limit} characters, the most this gateway tokenizes "
            "(setting gateway.local_tokenize_max_chars; a chat's prompt is its rendered "
            "template); send a shorter prompt or fewer messages",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )

    async def _local(
        self,
        route: ModelRoute,
        hashed: list[Endpoint],
        body: Mapping[str, Any],
        prompt: Prompt,
        chat: bool,
    ) -> list[int] | None:
        """The prompt's ids from the model's tokenizer files, in this process; None where it
        has no usable ones (the caller asks a replica). A sample is verified against a
        replica's /tokenize after the request went on its way."""
        self.sync()
        model = route.base
        if self.local.mode(model) != "local":
            return None
        t = time.perf_counter()
        messages = body.get("messages") if chat else None
        # ~30 characters of template around each message (ChatML's), for the wait only.
        rendered = len(prompt.text) + 30 * (len(messages) if isinstance(messages, list) else 0)
        got = await self.local.tokenize(
            model, body, chat=chat, chars=len(prompt.text), rendered=rendered
        )
        metrics = self._metrics
        if isinstance(got, str):
            metrics.inc(metrics.tokenize_failures, route.name, f"local_{got}")
            if got == "too_long":
                chars = len(prompt.text)
                raise self._too_long(chars if chars > self.local.max_chars else None, chat)
            return None
        ids, verify = got
        metrics.observe(metrics.tokenize_local_seconds, time.perf_counter() - t, route.name)
        payload = tokenize_payload(route.name, body, chat=chat)
        remote = self._remote
        if verify and payload is not None and remote is not None:
            target = self._least_loaded(hashed)
            self.local.verify(
                model,
                ids,
                lambda: remote.tokenize(target, payload, timeout_s=_VERIFY_TIMEOUT_S),
                self._on_verdict,
            )
        return ids

    async def _ask_replica(
        self, route: ModelRoute, hashed: list[Endpoint], body: Mapping[str, Any], chat: bool
    ) -> list[int] | None:
        """The ids from the least-loaded hashing replica's /tokenize, within the routing
        budget; None when it cannot say in time."""
        payload = tokenize_payload(route.name, body, chat=chat)
        if payload is None or self._remote is None:
            return None
        target = self._least_loaded(hashed)
        t = time.perf_counter()
        got = await self._remote.tokenize(target, payload)
        metrics = self._metrics
        if isinstance(got, str):
            metrics.inc(metrics.tokenize_failures, route.name, got)
            return None
        metrics.observe(metrics.tokenize_seconds, time.perf_counter() - t, route.name)
        return got

    def _least_loaded(self, eps: list[Endpoint]) -> Endpoint:
        load = self._load
        return min(eps, key=lambda ep: (load.load(ep.replica), ep.replica))

    def _on_verdict(self, verdict: Verdict) -> None:
        if not verdict.match:
            self._metrics.inc(self._metrics.tokenizer_mismatches, verdict.model)
            self.report_modes()
