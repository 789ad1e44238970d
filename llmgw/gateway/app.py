"""The public listener's app: the OpenAI API, as a pure ASGI application.

A request reads top to bottom, one step per module: path -> key (``keys``, from the header,
before any body byte is read) -> body (capped, ``llmgw.http.bodies``) -> model (allow-list, route
table) -> limits (``limits``: reserve) -> router (``routing_inputs`` assembles what the pure
``router.decide`` weighs; tokens from the model's own files in process, ``local_tokens``,
verified on a sample against an engine's /tokenize, which is also the fallback) -> upstream
(``upstream``: the replica's agent proxy, pooled aiohttp, the retry rule) -> answer, passed
through (``relay``) -> settle. This module parses, admits, routes and relays: it orchestrates
the steps and holds none of them.

No framework router and no ``BaseHTTPMiddleware`` on this path: four fixed paths are string
compares, and a middleware that wraps ``send`` in a task per response is measurable at the
gateway's target of 1.5 ms added per request (bench/gateway.py).

A client that leaves before the answer's headers cancels the upstream request, so the engine
aborts instead of generating for nobody (``relay.DisconnectWatch``).

What it must NOT do: read a body before the key is authenticated, echo a secret (the engine
key, the client's key), or serve anything of the control plane's internal API.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from starlette.types import Message, Receive, Scope, Send

from llmgw.config import GatewaySettings
from llmgw.eventloop import cancel_and_wait
from llmgw.gateway.errors import (
    GatewayError,
    bad_request,
    body_too_large,
    method_not_allowed,
    unknown_url,
)
from llmgw.gateway.flow import FlowControl
from llmgw.gateway.load import LoadTracker
from llmgw.gateway.local_tokens import MODES, LocalTokenizers, Verdict
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.relay import DisconnectWatch, Relay
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.gateway.routing.approx import ApproxTree
from llmgw.gateway.routing.inputs import (
    INDEX_POLICIES,
    NO_PREFIX,
    TREE_POLICIES,
    KvView,
    RestartWatch,
    Routed,
    block_size,
    claim_of,
    claims_tree,
    prefix_inputs,
    routed,
    session_of,
    tree_key,
)
from llmgw.gateway.routing.router import Candidate, decide
from llmgw.gateway.tokenize import Tokenizer, tokenize_payload
from llmgw.gateway.upstream import Busy, Upstream
from llmgw.gateway.wire import (
    Prompt,
    Settleable,
    ask_for_usage,
    header,
    prompt_of,
    reserve_tokens,
    send_json,
)
from llmgw.http.bodies import (
    BadContentLength,
    BadJson,
    BodyTooLarge,
    ClientGone,
    declared_length,
    parse_json,
    read_asgi,
)
from llmgw.kv.hf_tokenizer import TokenizerFiles
from llmgw.logs import get_logger

__all__ = ["Gateway", "KeyInfo", "RouteSource"]

log = get_logger("llmgw.gateway")

_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"
_MODELS = "/v1/models"
# Characters per token when estimating a prompt's length before it is tokenized: low on
# purpose, so a prompt is rather tokenized once too often than never.
_CHARS_PER_TOKEN = 3
# A verification is off the request path: it may wait for a busy replica's /tokenize longer
# than routing would (a sample lost to a timeout is only asked again later).
_VERIFY_TIMEOUT_S = 2.0


class KeyInfo(Protocol):
    """What the gateway reads of an authenticated key (``keys.KeyContext`` is one)."""

    @property
    def key_id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def allowed_models(self) -> frozenset[str] | None: ...
    @property
    def cache_salt(self) -> str | None: ...


class RouteSource(Protocol):
    """Where the route table comes from (``routes.RouteCache``, kept current by it)."""

    @property
    def table(self) -> RouteTable: ...


class TokenizerSource(Protocol):
    """Each model's tokenizer files (``tokenizer_files.TokenizerFilesCache``, kept current by
    it from Postgres): served model name -> files."""

    @property
    def files(self) -> Mapping[str, TokenizerFiles]: ...


K = TypeVar("K", bound=KeyInfo)


@dataclass
class Gateway(Generic[K]):
    """The ASGI app. ``authenticate`` and ``admit`` are ``keys.KeyCache.authenticate`` and
    ``limits.Limiter.admit``; ``intake`` is this process's KV index, which the agent API feeds
    (None: no precise routing); ``starts`` and ``stops`` start and stop with the app (started
    in order, stopped in reverse: the usage recorder's stop is the flush, after the last
    stream ended)."""

    settings: GatewaySettings
    routes: RouteSource
    authenticate: Callable[[str | None], K]
    admit: Callable[[K, str, int], Settleable]
    metrics: GatewayMetrics
    intake: KvView | None = None
    # Where precise routing's tokenizer files come from (None: always a replica's /tokenize).
    tokenizer_files: TokenizerSource | None = None
    starts: Sequence[Callable[[], Awaitable[None]]] = ()
    stops: Sequence[Callable[[], Awaitable[None]]] = ()
    clock: Callable[[], float] = time.monotonic
    _tokenizer: Tokenizer | None = field(default=None, init=False)
    _rotation: int = field(default=0, init=False)
    _stats_task: asyncio.Task[None] | None = field(default=None, init=False)
    _seen_table: RouteTable | None = field(default=None, init=False)
    _restarts: RestartWatch = field(default_factory=RestartWatch, init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.load = LoadTracker(
            eject_after=s.eject_after_failures, eject_for_s=s.eject_for_s, clock=self.clock
        )
        self.tree = ApproxTree(max_entries=s.approx_max_entries, ttl_s=s.approx_ttl_s)
        self.computing = claims_tree()
        self.flow = FlowControl(s, load=self.load, metrics=self.metrics, clock=self.clock)
        self.upstream = Upstream(
            s,
            load=self.load,
            computing=self.computing,
            metrics=self.metrics,
            clock=self.clock,
            windows=self.flow.windows,
        )
        self.relay = Relay(self.upstream, self.metrics, self.clock)
        self.local = LocalTokenizers(
            workers=s.local_tokenize_workers,
            timeout_s=s.local_tokenize_timeout_s,
            max_chars=s.local_tokenize_max_chars,
            verify_first=s.tokenizer_verify_first,
            verify_every=s.tokenizer_verify_every,
            inline_chars=s.local_tokenize_inline_chars,
        )
        self._random = random.Random()
        self.created = int(time.time())

    # --- lifespan ------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        http = self.upstream.open()
        self._tokenizer = Tokenizer(
            http, timeout_s=s.tokenize_timeout_s, concurrency=s.tokenize_concurrency
        )
        for start in self.starts:
            await start()
        await self.load.start(http, self._ready_endpoints, s.load_scrape_s)
        self._table()
        self._sync_tokenizers()
        await self.flow.start(refresh=self._table)
        self._stats_task = asyncio.create_task(self._stats(), name="gateway-stats")

    async def shutdown(self) -> None:
        # uvicorn has stopped accepting and let open streams finish (controlplane grace) by now.
        await cancel_and_wait(self._stats_task)
        await self.flow.stop()
        await self.load.stop()
        for stop in reversed(self.stops):
            try:
                await stop()
            except Exception:
                log.error("gateway_stop_failed", exc_info=True)
        await self.upstream.close()
        self.local.close()

    def _table(self) -> RouteTable:
        """The route table, having forgotten the claims on replicas whose engine restarted
        since the last table (a new process has an empty KV cache; until its blocks' events
        reach the index, and for the approximate tier at all, the trees would still send
        the restarted replica every prompt it was once sent, to recompute it)."""
        table = self.routes.table
        if table is self._seen_table:
            return table
        self._seen_table = table
        self.flow.configure(table)
        now = self.clock()
        endpoints = (ep for route in table.routes.values() for ep in route.endpoints)
        for replica in self._restarts.restarted(endpoints):
            self.tree.forget(replica, now=now)
            self.computing.forget(replica, now=now)
            log.info("gateway_replica_restarted", replica=replica)
        return table

    def _ready_endpoints(self) -> list[Endpoint]:
        seen: dict[str, Endpoint] = {}
        for route in self.routes.table.routes.values():
            for ep in route.endpoints:
                seen.setdefault(ep.replica, ep)
        return list(seen.values())

    async def _stats(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            self.metrics.approx_entries.set(len(self.tree))
            self._sync_tokenizers()
            self._report_tokenizer_modes()
            if self.intake is not None:
                index = self.intake.index
                for model in index.models():
                    self.metrics.index_blocks.labels(model).set(index.num_entries(model))

    def _sync_tokenizers(self) -> None:
        if self.tokenizer_files is not None and self.settings.local_tokenize:
            self.local.sync(self.tokenizer_files.files)

    def _report_tokenizer_modes(self) -> None:
        """``llmgw_prefix_tokenizer_mode``: per served model, 1 for how its prompts are
        tokenized, 0 for the other modes."""
        metrics = self.metrics
        for route in self.routes.table.routes.values():
            if route.lora is not None:
                continue
            mode = self.tokenizer_mode(route)
            for m in MODES:
                metrics.gauge(metrics.tokenizer_mode, 1.0 if m == mode else 0.0, route.name, m)
            none = 1.0 if route.tokenizer_none else 0.0
            metrics.gauge(metrics.tokenizer_profile_none, none, route.name)

    def tokenizer_mode(self, route: ModelRoute) -> str:
        """How precise routing tokenizes the route's prompts: "local", "remote" or "none"."""
        if self.intake is None or self.settings.routing_policy not in INDEX_POLICIES:
            return "none"
        if route.endpoints and not any(ep.hash is not None for ep in route.endpoints):
            return "none"
        if not self._tokenizes_locally(route):
            return "remote"
        return self.local.mode(route.base)

    def _tokenizes_locally(self, route: ModelRoute) -> bool:
        """Whether the route's prompts may be tokenized here at all: the setting allows it, and
        no profile serving the model says ``tokenizer: none``."""
        return self.settings.local_tokenize and not route.tokenizer_none

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.error("gateway_start_failed", exc_info=True)
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- ASGI ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            if path in (_CHAT, _COMPLETIONS):
                if method != "POST":
                    raise method_not_allowed(method, path, "POST")
                await self._generate(scope, receive, tracked, chat=path == _CHAT)
            elif path == _MODELS:
                if method not in ("GET", "HEAD"):
                    raise method_not_allowed(method, path, "GET")
                await self._models(scope, tracked)
            elif path == "/healthz":
                await send_json(tracked, 200, b'{"status":"ok"}')
            else:
                raise unknown_url(method, path)
        except GatewayError as exc:
            if started:
                raise
            headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
            if exc.status == 405:
                headers.append((b"allow", b"POST" if path in (_CHAT, _COMPLETIONS) else b"GET"))
            await send_json(tracked, exc.status, exc.body(), headers)
        except ClientGone:
            return

    async def _models(self, scope: Scope, send: Send) -> None:
        key = self.authenticate(header(scope, b"authorization"))
        allowed = key.allowed_models
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "llmgw",
                "root": route.base,
                "parent": route.base if route.lora is not None else None,
            }
            for name, route in sorted(self.routes.table.routes.items())
            if allowed is None or name in allowed
        ]
        body = json.dumps({"object": "list", "data": data}, separators=(",", ":")).encode()
        await send_json(send, 200, body)

    # --- generation ----------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        t0 = self.clock()
        key = self.authenticate(header(scope, b"authorization"))
        body, body_bytes = await self._read_json(scope, receive)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("`model` is required: a name from GET /v1/models", param="model")
        prompt = prompt_of(body, chat=chat)
        allowed = key.allowed_models
        route = self._table().get(model)
        if route is None or (allowed is not None and model not in allowed):
            self.metrics.inc(self.metrics.requests, "_unknown", "", "404")
            raise GatewayError.model_not_found(model)
        if not route.endpoints and not route.wakeable:  # wakeable: held, flow.py
            self.metrics.inc(self.metrics.requests, model, "", "503")
            raise GatewayError.no_ready_replica(model)

        stream = bool(body.get("stream"))
        client_usage = ask_for_usage(body) if stream else False
        if key.cache_salt:
            # The key's salt wins over anything the client sent: tenant isolation is the
            # operator's rule, not the client's choice.
            body["cache_salt"] = key.cache_salt
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None

        prompt_estimate = len(prompt.text) // _CHARS_PER_TOKEN
        limit = self.load.context_limit(ep.replica for ep in route.endpoints)
        reserve = reserve_tokens(
            body, chat, self.settings, context_limit=limit, prompt_tokens=prompt_estimate
        )
        admission = _Charged(self.admit(key, model, prompt_estimate + reserve), self.flow, model,
                             key.key_id)  # fmt: skip
        upstream = self.upstream
        flow = self.flow
        granted = False
        # The body is read whole: from here the watch cancels this task when the client
        # leaves, whether it waits in the queue (it leaves the queue at once) or is served.
        watch = DisconnectWatch(receive)
        try:
            await flow.enter(route, key.key_id, _priority(key), body_bytes, prompt_estimate)
            granted = True
            # Routed by the rules as they stand when it leaves the queue.
            route = self._table().get(model) or route
            if not route.endpoints:
                self.metrics.inc(self.metrics.requests, model, "", "503")
                raise GatewayError.no_ready_replica(model)
            upstream.budget.deposit()
            candidates = flow.with_room(upstream.candidates(route, exclude=()))
            chosen = await self._route(
                route, candidates, body, prompt, salt, scope, chat, estimate=prompt_estimate
            )
            prompt_tokens = chosen.prompt_tokens
            flow.charge(model, key.key_id, prompt_tokens)
            flow.routed(model, prompt_tokens, chosen.prefill)
            payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            self.metrics.in_flight.inc()
            try:
                # send counts the request in flight before its first await: the grant's
                # claim on the model's room passes to the replica's count in one step.
                granted = False
                flow.release(model)
                attempt = await upstream.send(
                    route,
                    chosen.replica,
                    payload,
                    scope["path"],
                    prefill=chosen.prefill,
                    prompt_tokens=prompt_tokens,
                    claim=chosen.claim,
                )
            except Busy:
                self.metrics.in_flight.dec()
                raise flow.shed_busy(model) from None
            except BaseException:
                self.metrics.in_flight.dec()
                raise
            replica = attempt.ep.replica
            try:
                if stream and attempt.resp.status == 200:
                    await self.relay.stream(
                        attempt, send, watch, admission, route, client_usage, prompt_tokens, t0
                    )
                else:
                    await self.relay.whole(attempt, send, admission, route, t0)
            finally:
                upstream.ended(replica, attempt.prefill, attempt.claim)
                self.metrics.in_flight.dec()
                attempt.resp.release()
        except asyncio.CancelledError:
            if watch.caused_cancel():
                raise ClientGone from None
            raise
        finally:
            # Before any other await: once the answer is complete, the server reports a
            # "disconnect" to whoever still listens, which must not cancel us.
            watch.close()
            if granted:
                flow.release(model)
            admission.release()
            # A replica's slot freed (or a grant came back): the next queued request goes.
            flow.dispatch()

    async def _read_json(self, scope: Scope, receive: Receive) -> tuple[dict[str, Any], int]:
        """The body as a JSON object, and its size in bytes."""
        cap = self.settings.max_body_bytes
        try:
            declared = declared_length(header(scope, b"content-length"))
            raw = await read_asgi(receive, cap, declared)
        except BodyTooLarge:
            raise body_too_large(cap, "gateway.max_body_bytes") from None
        except BadContentLength:
            raise bad_request("Content-Length is not a number", code="invalid_header") from None
        try:
            # Bounded here, once, for the whole request path: nesting (Python's parser raised
            # RecursionError at ~970 levels) and lone surrogates (encoding the body for the
            # engine raised) are refused before anything reads the body.
            data = parse_json(raw)
        except BadJson as exc:
            raise bad_request(str(exc), code="invalid_json") from None
        if not isinstance(data, dict):
            raise bad_request("the body must be a JSON object", code="invalid_json")
        return data, len(raw)

    # --- routing -------------------------------------------------------------------------

    async def _route(
        self,
        route: ModelRoute,
        eps: list[Endpoint],
        body: Mapping[str, Any],
        prompt: Prompt,
        salt: str | None,
        scope: Scope,
        chat: bool,
        *,
        estimate: int,
    ) -> Routed:
        """The replica for the request and what of its prompt it computes: ``router.decide``
        on what ``routing_inputs`` assembles. ``estimate``: the prompt's length in tokens
        from its characters."""
        s = self.settings
        policy = s.routing_policy
        load = self.load
        cands = [
            Candidate(ep.replica, ep.shard, load.load(ep.replica), load.work(ep.replica))
            for ep in eps
        ]
        self._rotation += 1
        session = session_of(header(scope, b"x-session-id"), body)
        now = self.clock()
        key = tree_key(route.name, salt)
        chunks: list[int] | None = None
        approx: dict[str, float] | None = None
        tokens: list[int] | None = None
        # Scored before tokenizing: the tree as it stood when the request came.
        if policy in TREE_POLICIES and prompt.text:
            chunks = self.tree.chunks(prompt.text)
            approx = self.tree.score(key, chunks, [c.replica for c in cands], now=now)
        if policy in INDEX_POLICIES and not prompt.multimodal:
            tokens = await self._tokens(route, eps, body, prompt, chat)
        inputs = NO_PREFIX
        if chunks is not None or tokens is not None:
            inputs = prefix_inputs(
                self.intake,
                self.tree,
                self.computing,
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
        decision = decide(
            cands,
            policy=policy,
            precise=inputs.precise,
            approximate=inputs.approximate,
            load_slack=s.load_slack,
            prompt_tokens=prompt_tokens,
            recompute_weight=s.recompute_weight,
            affinity_tokens=s.affinity_tokens,
            hot=inputs.hot,
            home=inputs.home,
            session=session,
            rotation=self._rotation,
            pick=self._random.random(),
        )
        metrics = self.metrics
        metrics.inc(metrics.decisions, route.name, decision.method, decision.outcome)
        if decision.method in ("precise", "approximate"):
            metrics.observe(metrics.matched_share, decision.share, route.name, decision.method)
        if chunks:
            self.tree.record(key, chunks, decision.replica, now=now)
        return routed(decision, inputs, prompt_tokens, claim_of(policy, eps, key, chunks))

    async def _tokens(
        self,
        route: ModelRoute,
        eps: list[Endpoint],
        body: Mapping[str, Any],
        prompt: Prompt,
        chat: bool,
    ) -> list[int] | None:
        """The prompt's token ids for precise routing; None where they would not be scored
        (no replica hashes KV events, no index), are not worth asking for (a prompt shorter
        than ``precise_min_blocks`` blocks) or could not be had in time."""
        hashed = [ep for ep in eps if ep.hash is not None]
        if not hashed or self.intake is None:
            return None
        if prompt.token_ids is not None:
            return prompt.token_ids
        block = block_size(hashed)
        if len(prompt.text) < self.settings.precise_min_blocks * block * _CHARS_PER_TOKEN:
            return None
        if self.tokenizer_files is not None and self._tokenizes_locally(route):
            local = await self._local_tokens(route, hashed, body, prompt, chat)
            if local is not None:
                return local
        payload = tokenize_payload(route.name, body, chat=chat)
        if payload is None or self._tokenizer is None:
            return None
        target = min(hashed, key=lambda ep: (self.load.load(ep.replica), ep.replica))
        t = time.perf_counter()
        got = await self._tokenizer.tokenize(target, payload)
        if isinstance(got, str):
            self.metrics.inc(self.metrics.tokenize_failures, route.name, got)
            return None
        self.metrics.observe(self.metrics.tokenize_seconds, time.perf_counter() - t, route.name)
        return got

    async def _local_tokens(
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
        self._sync_tokenizers()
        model = route.base
        if self.local.mode(model) != "local":
            return None
        t = time.perf_counter()
        got = await self.local.tokenize(model, body, chat=chat, chars=len(prompt.text))
        metrics = self.metrics
        if isinstance(got, str):
            metrics.inc(metrics.tokenize_failures, route.name, f"local_{got}")
            return None
        ids, verify = got
        metrics.observe(metrics.tokenize_local_seconds, time.perf_counter() - t, route.name)
        payload = tokenize_payload(route.name, body, chat=chat)
        remote = self._tokenizer
        if verify and payload is not None and remote is not None:
            target = min(hashed, key=lambda ep: (self.load.load(ep.replica), ep.replica))
            self.local.verify(
                model,
                ids,
                lambda: remote.tokenize(target, payload, timeout_s=_VERIFY_TIMEOUT_S),
                self._on_verdict,
            )
        return ids

    def _on_verdict(self, verdict: Verdict) -> None:
        if not verdict.match:
            self.metrics.inc(self.metrics.tokenizer_mismatches, verdict.model)
            self._report_tokenizer_modes()


def _priority(key: KeyInfo) -> int:
    """The key's queue priority (``keys.KeyContext.priority``; 0 for a key without one)."""
    value = getattr(key, "priority", 0)
    return value if isinstance(value, int) else 0


class _Charged:
    """The key's admission, also charging the completion tokens it settles to the queue's
    fairness counter (its prompt was charged when it was routed)."""

    __slots__ = ("_admission", "_flow", "_key_id", "_model")

    def __init__(self, admission: Settleable, flow: FlowControl, model: str, key_id: str):
        self._admission = admission
        self._flow = flow
        self._model = model
        self._key_id = key_id

    def settle(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self._flow.charge(self._model, self._key_id, completion_tokens)
        self._admission.settle(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        )

    def release(self) -> None:
        self._admission.release()
