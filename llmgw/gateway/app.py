"""The public listener's app: the OpenAI API, as a pure ASGI application.

A request reads top to bottom, one step per method, each step's work in its own module:

- parse (``_parse``): the key (``keys``, from the header, before any body byte is read), the
  body (capped and bounded, ``llmgw.http.bodies``), the model (the key's allow-list, the route
  table as ``table_view`` shows it), the fields it acts on as the engine reads them
  (``engine_fields``), the prompt (``wire``);
- admit (``_admit``): the key's limits reserve the request's tokens (``limits``), then it waits
  for room at the model's replicas (``flow``: queued fairly, or shed);
- route (``_route``): the replica, by ``route_step`` (what the pure ``router.decide`` weighs:
  load, the approximate tree, token ids from ``tokens`` scored against the KV index);
- send (``_send``): to the replica's agent proxy, pooled, retried once by ``upstream``'s rule;
- relay (``_relay``): the answer passed through, streamed or whole, and settled (``relay``).

Everything that lives longer than a request (start, stop, the stats loop) is ``lifespan``'s.

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
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from starlette.types import Message, Receive, Scope, Send

from llmgw.config import GatewaySettings
from llmgw.gateway.engine_fields import canonicalize
from llmgw.gateway.errors import (
    GatewayError,
    bad_request,
    body_too_large,
    method_not_allowed,
    unknown_url,
)
from llmgw.gateway.flow import Charged, FlowControl
from llmgw.gateway.lifespan import Lifespan
from llmgw.gateway.load import LoadTracker
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.relay import DisconnectWatch, Relay
from llmgw.gateway.route_step import RouteStep
from llmgw.gateway.routes import ModelRoute, RouteTable
from llmgw.gateway.routing.approx import ApproxTree
from llmgw.gateway.routing.inputs import KvView, Routed, claims_tree, session_of
from llmgw.gateway.table_view import TableView
from llmgw.gateway.tokens import CHARS_PER_TOKEN, TokenizerSource, Tokens
from llmgw.gateway.upstream import Attempt, Busy, Upstream
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
from llmgw.logs import get_logger

__all__ = ["Gateway", "KeyInfo", "RouteSource", "TokenizerSource"]

log = get_logger("llmgw.gateway")

_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"
_MODELS = "/v1/models"


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


K = TypeVar("K", bound=KeyInfo)


@dataclass(slots=True)
class _Asked(Generic[K]):
    """One generation request as parsed: who asks, for what, and how it wants the answer."""

    started: float  # clock() when it came
    path: str
    chat: bool
    key: K
    body: dict[str, Any]
    size: int  # of the body, in bytes
    model: str
    route: ModelRoute  # as the table stood when it came
    prompt: Prompt
    estimate: int  # the prompt's length in tokens, from its characters
    stream: bool
    client_usage: bool  # the client asked for a streamed usage chunk
    salt: str | None  # the prompt's cache salt (the key's wins)
    session: str | None


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
        self.table = TableView(
            self._table, flow=self.flow, trees=(self.tree, self.computing), clock=self.clock
        )
        self.tokens = Tokens(
            s,
            metrics=self.metrics,
            load=self.load,
            files=self.tokenizer_files,
            indexed=self.intake is not None,
            table=self._table,
        )
        self.router = RouteStep(
            s,
            load=self.load,
            tree=self.tree,
            computing=self.computing,
            intake=self.intake,
            tokens=self.tokens,
            metrics=self.metrics,
            clock=self.clock,
        )
        self.lifespan = Lifespan(
            s,
            upstream=self.upstream,
            tokens=self.tokens,
            load=self.load,
            flow=self.flow,
            table=self.table,
            tree=self.tree,
            intake=self.intake,
            metrics=self.metrics,
            starts=self.starts,
            stops=self.stops,
        )
        self.created = int(time.time())

    def _table(self) -> RouteTable:
        return self.routes.table

    # --- ASGI ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.lifespan.serve(receive, send)
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

    # --- generation: parse -> admit -> route -> send -> relay ----------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        asked = await self._parse(scope, receive, chat=chat)
        admission = self._admit(asked)
        flow = self.flow
        model = asked.model
        granted = False
        # The body is read whole: from here the watch cancels this task when the client
        # leaves, whether it waits in the queue (it leaves the queue at once) or is served.
        watch = DisconnectWatch(receive)
        try:
            await flow.enter(
                asked.route,
                asked.key.key_id,
                _priority(asked.key),
                asked.size,
                asked.estimate,
                held=(asked.body, asked.prompt.text),  # what it keeps alive if it is queued
            )
            granted = True
            route, chosen = await self._route(asked)
            payload = json.dumps(asked.body, separators=(",", ":"), ensure_ascii=False).encode()
            # _send hands the grant over before its first await (see there).
            granted = False
            attempt = await self._send(asked, route, chosen, payload)
            await self._relay(asked, route, chosen, attempt, send, watch, admission)
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

    async def _parse(self, scope: Scope, receive: Receive, *, chat: bool) -> _Asked[K]:
        """The request, authenticated and read; a ``GatewayError`` for a request that names
        no model it may use, or one no replica serves and none will."""
        started = self.clock()
        key = self.authenticate(header(scope, b"authorization"))
        body, size = await self._read_json(scope, receive)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("`model` is required: a name from GET /v1/models", param="model")
        # Before anything reads the body: the fields it acts on become the engine's values.
        canonicalize(body, chat=chat)
        prompt = prompt_of(body, chat=chat)
        allowed = key.allowed_models
        route = self.table.route(model)
        if route is None or (allowed is not None and model not in allowed):
            self.metrics.inc(self.metrics.requests, "_unknown", "", "404")
            raise GatewayError.model_not_found(model)
        if not route.endpoints and not route.wakeable:  # wakeable: held, flow.py
            self.metrics.inc(self.metrics.requests, model, "", "503")
            raise GatewayError.no_ready_replica(model)
        stream = bool(body.get("stream"))
        if key.cache_salt:
            # The key's salt wins over anything the client sent: tenant isolation is the
            # operator's rule, not the client's choice.
            body["cache_salt"] = key.cache_salt
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        return _Asked(
            started=started,
            path=scope["path"],
            chat=chat,
            key=key,
            body=body,
            size=size,
            model=model,
            route=route,
            prompt=prompt,
            estimate=len(prompt.text) // CHARS_PER_TOKEN,
            stream=stream,
            client_usage=ask_for_usage(body) if stream else False,
            salt=salt,
            session=session_of(header(scope, b"x-session-id"), body),
        )

    def _admit(self, asked: _Asked[K]) -> Charged:
        """The key's admission of the request's tokens (its prompt, estimated, and what it may
        generate), or the ``GatewayError`` (429) of the limit it would break."""
        limit = self.load.context_limit(ep.replica for ep in asked.route.endpoints)
        reserve = reserve_tokens(
            asked.body, asked.chat, self.settings, context_limit=limit, prompt_tokens=asked.estimate
        )
        admitted = self.admit(asked.key, asked.model, asked.estimate + reserve)
        return Charged(admitted, self.flow, asked.model, asked.key.key_id)

    async def _route(self, asked: _Asked[K]) -> tuple[ModelRoute, Routed]:
        """The request, granted room, routed by the rules as they stand when it leaves the
        queue: its route then, and the replica among those with room."""
        model = asked.model
        route = self.table.route(model) or asked.route
        if not route.endpoints:
            self.metrics.inc(self.metrics.requests, model, "", "503")
            raise GatewayError.no_ready_replica(model)
        upstream, flow = self.upstream, self.flow
        upstream.budget.deposit()
        candidates = flow.with_room(upstream.candidates(route, exclude=()))
        chosen = await self.router.route(
            route,
            candidates,
            asked.body,
            asked.prompt,
            chat=asked.chat,
            salt=asked.salt,
            session=asked.session,
            estimate=asked.estimate,
        )
        flow.charge(model, asked.key.key_id, chosen.prompt_tokens)
        flow.routed(model, chosen.prompt_tokens, chosen.prefill)
        return route, chosen

    async def _send(
        self, asked: _Asked[K], route: ModelRoute, chosen: Routed, payload: bytes
    ) -> Attempt:
        """The request sent to the chosen replica (or, by the retry rule, another): in flight
        from here, its model's grant handed over. A busy refusal no retry could place is shed
        (503), not a 502."""
        metrics = self.metrics
        metrics.in_flight.inc()
        try:
            # send counts the request in flight before its first await: the grant's claim on
            # the model's room passes to the replica's count in one step.
            self.flow.release(asked.model)
            return await self.upstream.send(
                route,
                chosen.replica,
                payload,
                asked.path,
                prefill=chosen.prefill,
                prompt_tokens=chosen.prompt_tokens,
                claim=chosen.claim,
            )
        except Busy:
            metrics.in_flight.dec()
            raise self.flow.shed_busy(asked.model) from None
        except BaseException:
            metrics.in_flight.dec()
            raise

    async def _relay(
        self,
        asked: _Asked[K],
        route: ModelRoute,
        chosen: Routed,
        attempt: Attempt,
        send: Send,
        watch: DisconnectWatch,
        admission: Charged,
    ) -> None:
        """The replica's answer passed to the client and settled; the request ends on the
        replica however it ends here."""
        try:
            if asked.stream and attempt.resp.status == 200:
                await self.relay.stream(
                    attempt,
                    send,
                    watch,
                    admission,
                    route,
                    asked.client_usage,
                    chosen.prompt_tokens,
                    asked.started,
                )
            else:
                await self.relay.whole(attempt, send, admission, route, asked.started)
        finally:
            self.upstream.ended(attempt.ep.replica, attempt.prefill, attempt.claim)
            self.metrics.in_flight.dec()
            attempt.resp.release()

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


def _priority(key: KeyInfo) -> int:
    """The key's queue priority (``keys.KeyContext.priority``; 0 for a key without one)."""
    value = getattr(key, "priority", 0)
    return value if isinstance(value, int) else 0
