"""The public listener's app: the OpenAI API, as a pure ASGI application (issue #11).

A request reads top to bottom: path -> key (from the header, before any body byte is read)
-> body (capped) -> model (allow-list, route table) -> limits (reserve) -> router (pure) ->
upstream (the replica's agent proxy, pooled aiohttp) -> answer, passed through -> settle.

No framework router and no ``BaseHTTPMiddleware`` on this path: four fixed paths are string
compares, and a middleware that wraps ``send`` in a task per response is measurable at the
gateway's target of 1.5 ms added per request (bench/gateway.py).

Streams pass through chunk by chunk as the engine sends them: each read from the engine is
forwarded before the next read; uvicorn's ``send`` waits while the client's socket buffer is
over its high-water mark (64 KiB) and aiohttp stops reading the engine's socket when its own
bounded buffer is full, so a slow client holds at most a few hundred KiB here and slows the
connection to the engine instead (backpressure, not accumulation). The gateway always asks the engine for usage on streams
(``stream_options.include_usage``) and drops the usage chunk when the client did not ask for
it. A client that disconnects mid-stream is settled for what was streamed (the usage if it
arrived, else one completion token per streamed chunk). A failure after the headers went out
ends the stream with an error event in OpenAI's shape.

Retries: only when the connection to the replica could not be made (directly, or as the agent's
proxy reports it: 502 ``upstream-unavailable``, or 404 ``not-found`` for a shard it no longer
serves) or the replica answered 503 before any header; at most once, to another replica (one
without recent failures first), within a retry budget (a token bucket filled by
``gateway.retry_budget_ratio`` per request). Anything else is not retried: the engine may have
started the work. A client that leaves before the answer's headers cancels the upstream request,
so the engine aborts instead of generating for nobody.

What it must NOT do: read a body before the key is authenticated, echo a secret (the engine
key, the client's key), or serve anything of the control plane's internal API.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
from starlette.types import Message, Receive, Scope, Send

from llmgw.config import GatewaySettings
from llmgw.controlplane.agentapi.kv_intake import KvIntake
from llmgw.controlplane.gateway.approx import ApproxTree
from llmgw.controlplane.gateway.errors import (
    GatewayError,
    bad_request,
    body_too_large,
    method_not_allowed,
    sse_error_event,
    unknown_url,
    upstream_failed,
)
from llmgw.controlplane.gateway.load import LoadTracker, RetryBudget
from llmgw.controlplane.gateway.metrics import GatewayMetrics
from llmgw.controlplane.gateway.router import (
    Candidate,
    HashParams,
    decide,
    home_key,
    hot_share,
    precise_shares,
    token_home_key,
)
from llmgw.controlplane.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.controlplane.gateway.tokenize import Tokenizer, tokenize_payload
from llmgw.controlplane.gateway.upstream import create_client, read_capped
from llmgw.controlplane.gateway.wire import (
    Admission,
    ClientGone,
    Prompt,
    StreamState,
    filter_events,
    header,
    internal_error,
    prompt_of,
    reserve_tokens,
    send_json,
    settle,
    usage_of,
    wait_disconnect,
)
from llmgw.logs import get_logger

__all__ = ["Admission", "Gateway", "KeyInfo", "RouteSource", "internal_error"]

log = get_logger("llmgw.controlplane.gateway")

_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"
_MODELS = "/v1/models"
# Characters per token when estimating a prompt's length before it is tokenized: low on
# purpose, so a prompt is rather tokenized once too often than never.
_CHARS_PER_TOKEN = 3


class KeyInfo(Protocol):
    """What the gateway reads of an authenticated key (K2's ``KeyContext``)."""

    @property
    def key_id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def allowed_models(self) -> frozenset[str] | None: ...
    @property
    def cache_salt(self) -> str | None: ...


class RouteSource(Protocol):
    @property
    def table(self) -> RouteTable: ...


K = TypeVar("K", bound=KeyInfo)


@dataclass(slots=True)
class _Attempt:
    ep: Endpoint
    resp: aiohttp.ClientResponse
    prefill: float  # prompt tokens the replica computes, counted as its work until the 1st token
    track: _Track | None  # the prompt's claim in Gateway.computing, until the 1st token


# (tree key, chunk hashes) of a prompt whose prefill a replica is computing for this gateway.
_Track = tuple[str, list[int]]


@dataclass(frozen=True, slots=True)
class _Routed:
    replica: str
    prompt_tokens: int  # tokenized for precise routing, else the estimate from characters
    prefill: float  # what of them the chosen replica computes, as far as the gateway can tell
    track: _Track | None  # to claim in Gateway.computing while it does


def _block_size(eps: Sequence[Endpoint]) -> int:
    """The smallest KV block among endpoints that hash KV events (precise routing's unit)."""
    return min(ep.hash.block_size for ep in eps if ep.hash is not None)


# KV events reach the index within about this long after an engine computed the blocks (the
# agent relays them as they come); until then the gateway's own record says where they are.
_INDEX_LAG_S = 2.0
# Prompts being computed, all models together: in-flight requests' chunks, a few per request.
_COMPUTING_MAX_ENTRIES = 50_000
# Replicas whose engine process the gateway remembers (to see a restart), out of the table
# included; past it only those in the table are kept.
_MAX_INCARNATIONS = 100_000


@dataclass
class Gateway(Generic[K]):
    """The ASGI app. ``authenticate`` and ``admit`` are K2's ``KeyCache.authenticate`` and
    ``Limiter.admit``; ``hooks`` start and stop with the app (started in order, stopped in
    reverse: the usage recorder's stop is the flush, after the last stream ended)."""

    settings: GatewaySettings
    routes: RouteSource
    authenticate: Callable[[str | None], K]
    admit: Callable[[K, str, int], Admission]
    metrics: GatewayMetrics
    intake: KvIntake | None = None
    starts: Sequence[Callable[[], Awaitable[None]]] = ()
    stops: Sequence[Callable[[], Awaitable[None]]] = ()
    clock: Callable[[], float] = time.monotonic
    _http: aiohttp.ClientSession | None = field(default=None, init=False)
    _tokenizer: Tokenizer | None = field(default=None, init=False)
    _rotation: int = field(default=0, init=False)
    _stats_task: asyncio.Task[None] | None = field(default=None, init=False)
    _seen_table: RouteTable | None = field(default=None, init=False)
    # replica -> the engine process behind it when last seen (Endpoint.incarnation)
    _incarnations: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.load = LoadTracker(
            eject_after=s.eject_after_failures, eject_for_s=s.eject_for_s, clock=self.clock
        )
        self.tree = ApproxTree(max_entries=s.approx_max_entries, ttl_s=s.approx_ttl_s)
        # What this gateway's requests are computing where, claimed until their first token
        # (+inf) and for _INDEX_LAG_S after: what a replica holds before the index can say.
        self.computing = ApproxTree(
            max_entries=_COMPUTING_MAX_ENTRIES, ttl_s=_INDEX_LAG_S, fork_half_life_s=None
        )
        self.budget = RetryBudget(ratio=s.retry_budget_ratio)
        self._random = random.Random()
        self.created = int(time.time())

    # --- lifespan ------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        self._http = create_client(
            pool_size=s.upstream_pool_size,
            connect_timeout_s=s.upstream_connect_timeout_s,
            read_timeout_s=s.upstream_read_timeout_s,
        )
        self._tokenizer = Tokenizer(
            self._http, timeout_s=s.tokenize_timeout_s, concurrency=s.tokenize_concurrency
        )
        for start in self.starts:
            await start()
        await self.load.start(self._http, self._ready_endpoints, s.load_scrape_s)
        self._stats_task = asyncio.create_task(self._stats(), name="gateway-stats")

    async def shutdown(self) -> None:
        # uvicorn has stopped accepting and let open streams finish (controlplane grace) by now.
        if self._stats_task is not None:
            self._stats_task.cancel()
        await self.load.stop()
        for stop in reversed(self.stops):
            try:
                await stop()
            except Exception:
                log.error("gateway_stop_failed", exc_info=True)
        if self._http is not None:
            await self._http.close()

    def _table(self) -> RouteTable:
        """The route table, having forgotten the claims on replicas whose engine restarted
        since the last table (a new process has an empty KV cache; until its blocks' events
        reach the index, and for the approximate tier at all, the trees would still send
        the restarted replica every prompt it was once sent, to recompute it)."""
        table = self.routes.table
        if table is self._seen_table:
            return table
        self._seen_table = table
        now = self.clock()
        seen = self._incarnations
        current: dict[str, str] = {}
        for route in table.routes.values():
            for ep in route.endpoints:
                current[ep.replica] = ep.incarnation
                was = seen.get(ep.replica)
                if was and ep.incarnation and was != ep.incarnation:
                    self.tree.forget(ep.replica, now=now)
                    self.computing.forget(ep.replica, now=now)
                    log.info("gateway_replica_restarted", replica=ep.replica)
        # Replicas out of the table (restarting, draining) keep their last process, to be
        # compared when they return; replicas long gone are dropped past a bound.
        if len(seen) + len(current) > _MAX_INCARNATIONS:
            seen.clear()
        seen.update(current)
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
            if self.intake is not None:
                for model in self.intake.index.models():
                    self.metrics.index_blocks.labels(model).set(
                        self.intake.index.num_entries(model)
                    )

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
        body = await self._read_json(scope, receive)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("`model` is required: a name from GET /v1/models", param="model")
        prompt = prompt_of(body, chat=chat)
        allowed = key.allowed_models
        route = self._table().get(model)
        if route is None or (allowed is not None and model not in allowed):
            self.metrics.inc(self.metrics.requests, "_unknown", "", "404")
            raise GatewayError.model_not_found(model)
        if not route.endpoints:
            self.metrics.inc(self.metrics.requests, model, "", "503")
            raise GatewayError.no_ready_replica(model)

        stream = bool(body.get("stream"))
        client_usage = False
        if stream:
            opts = body.get("stream_options")
            opts = dict(opts) if isinstance(opts, dict) else {}
            client_usage = bool(opts.get("include_usage"))
            opts["include_usage"] = True
            body["stream_options"] = opts
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
        admission = self.admit(key, model, prompt_estimate + reserve)
        try:
            self.budget.deposit()
            candidates = self._candidates(route, exclude=())
            routed = await self._route(
                route, candidates, body, prompt, salt, scope, chat, estimate=prompt_estimate
            )
            prompt_tokens = routed.prompt_tokens
            payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            self.metrics.in_flight.inc()
            # A client that leaves while the engine works (a non-streamed answer's headers
            # come only when it is complete) cancels the request: the engine sees the
            # connection close and aborts, instead of generating for nobody.
            watch = _DisconnectWatch(receive)
            try:
                try:
                    attempt = await self._send_upstream(
                        route,
                        routed.replica,
                        payload,
                        scope["path"],
                        prefill=routed.prefill,
                        prompt_tokens=prompt_tokens,
                        track=routed.track,
                    )
                except BaseException:
                    self.metrics.in_flight.dec()
                    raise
                replica = attempt.ep.replica
                try:
                    if stream and attempt.resp.status == 200:
                        await self._relay_stream(
                            attempt, send, watch, admission, route, client_usage, prompt_tokens, t0
                        )
                    else:
                        await self._relay_whole(attempt, send, admission, route, t0)
                finally:
                    self._ended(replica, attempt.prefill, attempt.track)
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
        finally:
            admission.release()

    async def _read_json(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        cap = self.settings.max_body_bytes
        declared = header(scope, b"content-length")
        if declared is not None:
            try:
                if int(declared) > cap:
                    raise body_too_large(cap, "gateway.max_body_bytes")
            except ValueError:
                raise bad_request("Content-Length is not a number", code="invalid_header") from None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > cap:
                raise body_too_large(cap, "gateway.max_body_bytes")
            chunks.append(part)
            if not message.get("more_body", False):
                break
        try:
            data = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(
                f"the body is not valid JSON ({type(exc).__name__})", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise bad_request("the body must be a JSON object", code="invalid_json")
        return data

    # --- routing -------------------------------------------------------------------------

    def _candidates(self, route: ModelRoute, exclude: Sequence[str]) -> list[Endpoint]:
        eps = [ep for ep in route.endpoints if ep.replica not in exclude]
        healthy = [ep for ep in eps if self.load.healthy(ep.replica)]
        return healthy or eps

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
    ) -> _Routed:
        """``estimate``: the prompt's length in tokens from its characters."""
        policy = self.settings.routing_policy
        load = self.load
        cands = [
            Candidate(ep.replica, ep.shard, load.load(ep.replica), load.work(ep.replica))
            for ep in eps
        ]
        self._rotation += 1
        session = header(scope, b"x-session-id") or (
            body.get("user") if isinstance(body.get("user"), str) else None
        )
        now = self.clock()
        tree_key = f"{route.name}\0{salt or ''}"
        chunks: list[int] | None = None
        approx: dict[str, float] | None = None
        precise: dict[str, float] | None = None
        tokens: list[int] | None = None
        home: str | None = None  # where the request's session lives (router.home_key)
        # The precise policy consults the tree too: it is precise routing's fallback.
        if policy in ("auto", "approximate", "precise") and prompt.text:
            chunks = self.tree.chunks(prompt.text)
            approx = self.tree.score(tree_key, chunks, [c.replica for c in cands], now=now)
        if policy in ("auto", "precise") and not prompt.multimodal:
            tokens = await self._tokens(route, eps, body, prompt, chat)
            if tokens is not None:
                precise = self._precise(route, eps, cands, tokens, salt) or None
            if precise is not None and tokens is not None:
                home = token_home_key(tokens, _block_size(eps), precise.values())
            if precise is not None and chunks:
                # The index hears of blocks only after they are computed, through the
                # agent's event relay, and the next turn of a chat may come sooner: until
                # then a replica holds what this gateway sent it, whatever the index says
                # (else that turn would find only the system prompt, held everywhere).
                computing = self.computing.score(
                    tree_key, chunks, [c.replica for c in cands], now=now
                )
                precise = {r: max(v, computing.get(r, 0.0)) for r, v in precise.items()}
        if home is None and chunks and approx is not None:
            home = home_key(chunks, approx.values())
        hot = 0.0
        if chunks and approx is not None:
            # Each candidate as decide() scores it: precisely where it can, else by the tree.
            view = approx if precise is None else {**approx, **precise}
            forks = self.tree.fork_shares(tree_key, chunks, now=now)
            hot = hot_share(forks, len(chunks), view.values())
        prompt_tokens = len(tokens) if tokens is not None else estimate
        decision = decide(
            cands,
            policy=policy,
            precise=precise,
            approximate=approx,
            load_slack=self.settings.load_slack,
            prompt_tokens=prompt_tokens,
            recompute_weight=self.settings.recompute_weight,
            affinity_tokens=self.settings.affinity_tokens,
            hot=hot,
            home=home,
            session=session,
            rotation=self._rotation,
            pick=self._random.random(),
        )
        self.metrics.inc(self.metrics.decisions, route.name, decision.method, decision.outcome)
        if decision.method in ("precise", "approximate"):
            self.metrics.observe(
                self.metrics.matched_share, decision.share, route.name, decision.method
            )
        if chunks:
            self.tree.record(tree_key, chunks, decision.replica, now=now)
        # What of the prompt the replica holds, as far as this gateway can tell: its KV view
        # (or a prefill of ours in flight there) where it was scored precisely. A decision
        # the tree made because the index shows no holder is a miss on the index's word,
        # and its prefill is counted whole, or the replica looks idle while it computes.
        held = decision.share
        if precise is not None and decision.replica in precise:
            held = precise[decision.replica]
        # Claimed only where a later request may be scored precisely (the claim stands in
        # for the index until its events arrive); elsewhere it would be work for nothing.
        precise_route = policy in ("auto", "precise") and any(ep.hash is not None for ep in eps)
        track = (tree_key, chunks) if chunks and precise_route else None
        return _Routed(decision.replica, prompt_tokens, (1.0 - held) * prompt_tokens, track)

    async def _tokens(
        self,
        route: ModelRoute,
        eps: list[Endpoint],
        body: Mapping[str, Any],
        prompt: Prompt,
        chat: bool,
    ) -> list[int] | None:
        hashed = [ep for ep in eps if ep.hash is not None]
        if not hashed or self.intake is None:
            return None
        if prompt.token_ids is not None:
            return prompt.token_ids
        block = _block_size(hashed)
        if len(prompt.text) < self.settings.precise_min_blocks * block * _CHARS_PER_TOKEN:
            return None
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

    def _precise(
        self,
        route: ModelRoute,
        eps: list[Endpoint],
        cands: list[Candidate],
        tokens: list[int],
        salt: str | None,
    ) -> dict[str, float]:
        assert self.intake is not None
        intake = self.intake
        by_replica = {c.replica: c for c in cands}
        groups: dict[tuple[str, HashParams], list[Candidate]] = {}
        # vLLM >= 0.31 ("tagged") hashes a LoRA adapter's path, and an adapter fetched from a
        # URL runs from a node-local file whose path only its agent knows: hashing with the
        # URL would score every replica 0, a precise decision silently wrong. Those replicas
        # are left to the approximate tier.
        unknowable = route.lora is not None and "://" in route.lora[1]
        for ep in eps:
            if ep.hash is not None and not (unknowable and ep.hash.extra_key_format == "tagged"):
                groups.setdefault((ep.index_model, ep.hash), []).append(by_replica[ep.replica])

        def complete(shard: str) -> bool:
            return intake.is_complete(shard) and not intake.index.is_partial(shard)

        out: dict[str, float] = {}
        for (index_model, params), members in groups.items():
            out.update(
                precise_shares(
                    intake.index,
                    index_model,
                    tokens,
                    {params: members},
                    complete=complete,
                    cache_salt=salt,
                    lora=route.lora,
                )
            )
        return out

    # --- upstream ------------------------------------------------------------------------

    async def _send_upstream(
        self,
        route: ModelRoute,
        replica: str,
        payload: bytes,
        path: str,
        *,
        prefill: float,
        prompt_tokens: int,
        track: _Track | None = None,
    ) -> _Attempt:
        """Send to ``replica``, retried once elsewhere on a connection error or a 503 before
        any header. ``prefill``: what of the prompt ``replica`` computes (a retry's replica
        is taken to compute all ``prompt_tokens``)."""
        assert self._http is not None
        ep = next(e for e in route.endpoints if e.replica == replica)
        tried: list[str] = []
        while True:
            tried.append(ep.replica)
            why: str
            # Counted from before the request is sent: a non-streamed answer's headers come
            # only when it is complete, and the replica is busy with it all along.
            self.load.started(ep.replica, prefill)
            if track is not None:
                self.computing.record(*track, ep.replica, now=math.inf)
            try:
                resp = await self._http.post(
                    ep.url + path,
                    data=payload,
                    headers={
                        "Authorization": f"Bearer {ep.api_key}",
                        "Content-Type": "application/json",
                    },
                    allow_redirects=False,
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                self._ended(ep.replica, prefill, track, computed=False)
                why, kind = "connection refused, unreachable or timed out", "connect"
            except (aiohttp.ClientError, TimeoutError) as exc:
                # The request may have reached the engine: never retried (it may be running).
                self._ended(ep.replica, prefill, track, computed=False)
                kind = "timeout" if isinstance(exc, TimeoutError) else "disconnect"
                self._failed(route, ep, kind)
                raise upstream_failed(route.name, type(exc).__name__) from None
            except BaseException:  # cancelled: the count must not leak
                self._ended(ep.replica, prefill, track)
                raise
            else:
                try:
                    unreached = await _proxy_unreached(resp)
                except BaseException:
                    resp.release()
                    self._ended(ep.replica, prefill, track)
                    raise
                if resp.status != 503 and unreached is None:
                    self.load.succeeded(ep.replica)
                    return _Attempt(ep, resp, prefill, track)
                resp.release()
                self._ended(ep.replica, prefill, track, computed=False)
                why = unreached or "the replica answered 503"
                kind = "connect" if unreached else "status"
            self._failed(route, ep, kind)
            others = self._candidates(route, exclude=tried)
            if len(tried) > 1 or not others or not self.budget.withdraw():
                raise upstream_failed(route.name, why)
            self.metrics.inc(self.metrics.retries, route.name)
            ep = min(
                others,
                key=lambda e: (self.load.failures(e.replica), self.load.load(e.replica), e.replica),
            )
            prefill = float(prompt_tokens)

    def _computed(self, replica: str, prefill: float, track: _Track | None) -> None:
        """The first token came: the prefill queues no one, its blocks are on their way."""
        self.load.prefilled(replica, prefill)
        if track is not None:
            self.computing.record(*track, replica, now=self.clock())

    def _ended(
        self, replica: str, prefill: float, track: _Track | None, *, computed: bool = True
    ) -> None:
        """The request ended (answered, failed or cancelled); what of it was not yet
        counted off at a first token is now. A request that failed (``computed`` False)
        leaves no claim: the replica most likely holds none of it."""
        self.load.finished(replica, prefill)
        if track is None:
            return
        if computed:
            self.computing.record(*track, replica, now=self.clock())
        else:
            self.computing.drop(*track, replica)

    def _failed(self, route: ModelRoute, ep: Endpoint, kind: str) -> None:
        self.metrics.inc(self.metrics.upstream_errors, route.name, ep.replica, kind)
        if self.load.failed(ep.replica):
            self.metrics.inc(self.metrics.ejections, ep.replica)

    async def _relay_whole(
        self, attempt: _Attempt, send: Send, admission: Admission, route: ModelRoute, t0: float
    ) -> None:
        resp, ep = attempt.resp, attempt.ep
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._failed(route, ep, "midstream")
            raise upstream_failed(route.name, f"reading the answer: {type(exc).__name__}") from None
        status = resp.status
        if status >= 500:
            self._failed(route, ep, "status")
            self.metrics.inc(self.metrics.requests, route.name, ep.replica, "502")
            raise upstream_failed(route.name, f"the replica answered {status}")
        usage = usage_of(raw) if status == 200 else None
        settle(admission, usage, completion_fallback=0, prompt_fallback=0)
        ctype = resp.headers.get("Content-Type", "application/json").encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(raw)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": raw})
        self.metrics.inc(self.metrics.requests, route.name, ep.replica, str(status))
        self.metrics.observe(
            self.metrics.request_seconds, self.clock() - t0, route.name, ep.replica
        )

    async def _relay_stream(
        self,
        attempt: _Attempt,
        send: Send,
        watch: _DisconnectWatch,
        admission: Admission,
        route: ModelRoute,
        client_usage: bool,
        prompt_tokens: int,
        t0: float,
    ) -> None:
        ep = attempt.ep
        state = StreamState()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        try:
            await self._pump(attempt, send, state, client_usage, route)
        except asyncio.CancelledError:
            if not watch.caused_cancel():
                raise
            # Billed for what was streamed (settled below), and not an error of ours.
            log.info("gateway_client_gone", model=route.name, replica=ep.replica,
                     chunks=state.chunks)  # fmt: skip
        finally:
            settle(
                admission,
                state.usage,
                completion_fallback=state.chunks,
                prompt_fallback=prompt_tokens,
            )
        labels = (route.name, ep.replica)
        self.metrics.inc(self.metrics.requests, *labels, "200")
        self.metrics.observe(self.metrics.request_seconds, self.clock() - t0, *labels)
        if state.first_at is not None:
            self.metrics.observe(self.metrics.ttft_seconds, state.first_at - t0, *labels)

    async def _pump(
        self,
        attempt: _Attempt,
        send: Send,
        state: StreamState,
        client_usage: bool,
        route: ModelRoute,
    ) -> None:
        resp, ep = attempt.resp, attempt.ep
        pending = b""
        try:
            async for data in resp.content.iter_any():
                pending += data
                cut = pending.rfind(b"\n\n")
                if cut < 0:
                    continue
                events, pending = pending[: cut + 2], pending[cut + 2 :]
                out = filter_events(events, state, client_usage, self.clock)
                if state.first_at is not None and (attempt.prefill or attempt.track):
                    # The first token: this prompt's prefill no longer queues anyone, and
                    # its blocks are on their way to the index.
                    self._computed(ep.replica, attempt.prefill, attempt.track)
                    attempt.prefill, attempt.track = 0.0, None
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._failed(route, ep, "midstream")
            log.warning("gateway_stream_failed", model=route.name, replica=ep.replica,
                        error=type(exc).__name__)  # fmt: skip
            error = sse_error_event(
                f"the replica serving {route.name!r} failed mid-stream "
                f"({type(exc).__name__}); the answer is incomplete",
                type_="api_error",
                code="upstream_error",
            )
            await send({"type": "http.response.body", "body": error, "more_body": True})
        else:
            if pending.strip():
                out = filter_events(pending, state, client_usage, self.clock)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# The agent proxy's answers that mean "the request never reached an engine": it could not
# connect to it (502), or it no longer serves the shard (404, a route table a moment stale).
# They are the proxy's spelling of a connection error, retried like one.
_PROXY_UNREACHED = {502: "upstream-unavailable", 404: "not-found"}
# The proxy's error bodies are a few hundred bytes; a bigger one is not the proxy's.
_PROXY_ERROR_MAX_BYTES = 64 * 1024


async def _proxy_unreached(resp: aiohttp.ClientResponse) -> str | None:
    code = _PROXY_UNREACHED.get(resp.status)
    if code is None:
        return None
    try:
        body = json.loads(await read_capped(resp, _PROXY_ERROR_MAX_BYTES) or b"")
    except (ValueError, aiohttp.ClientError, TimeoutError):
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("code") == code:
        return f"the agent's proxy answered {resp.status} ({code})"
    return None


class _DisconnectWatch:
    """Cancels the request's own task when its client disconnects.

    One watcher task per request, the work staying in the request's task: a task for the
    work and ``asyncio.wait`` on both cost more CPU than the rest of the routing
    (bench/gateway.py). Armed only once the request body is fully read: from then on
    ``receive`` returns nothing but the disconnect. ``close`` must come before the task's
    next await once the answer is complete, when the server reports a disconnect to
    whoever still listens."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self.gone = False
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        await wait_disconnect(receive)
        self.gone = True
        self._task.cancel()

    def caused_cancel(self) -> bool:
        """Whether the CancelledError being handled is the disconnect's (then it is taken
        back, so the task's later awaits are not cancelled) rather than a shutdown's."""
        if not self.gone:
            return False
        self._task.uncancel()
        return True

    def close(self) -> None:
        self._watcher.cancel()
