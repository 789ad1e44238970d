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
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar

from starlette.types import Message, Receive, Scope, Send

from llmgw.config import GatewaySettings
from llmgw.gateway.apis import families, prompts
from llmgw.gateway.apis.anthropic_errors import body_of as anthropic_body
from llmgw.gateway.apis.families import Family, Match, Miss
from llmgw.gateway.apis.response_ids import EngineRef, ResponseIdRefused, ResponseIds
from llmgw.gateway.engine_fields import canonicalize
from llmgw.gateway.errors import (
    GatewayError,
    bad_request,
    body_too_large,
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
from llmgw.gateway.runtime_adapters import unknown_model_hint
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

_MODELS = "/v1/models"
# The families whose body is a chat once converted (tokenized by the model's chat template).
_CHAT_SHAPED = frozenset({"chat", "responses", "messages", "count_tokens"})


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

    async def catch_up(self) -> None:
        """Return once the table was re-read after this call (a model it lacks may have been
        declared a moment ago)."""


K = TypeVar("K", bound=KeyInfo)


@dataclass(slots=True)
class _Asked(Generic[K]):
    """One generation request as parsed: who asks, for what, and how it wants the answer."""

    started: float  # clock() when it came
    path: str  # the engine's path for it
    match: Match  # the family and route it asked for
    chat: bool  # tokenized as a chat (chat, and the families the engine renders as one)
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
    # What the router tokenizes: the body itself, or the chat a Responses or Messages body is
    # rendered as (``apis.prompts``).
    routed_body: dict[str, Any]
    # A Responses follow-up: the replica holding its stored response, the only one to send to.
    pinned: EngineRef | None = None

    @property
    def family(self) -> Family:
        return self.match.family


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
    # Response ids under the cluster's secret (``asgi`` reads it from the database, so every
    # gateway of the cluster unwraps what another wrapped); None: a secret of this process's
    # own, for a gateway that is alone (tests).
    response_ids: ResponseIds | None = None

    def __post_init__(self) -> None:
        s = self.settings
        if self.response_ids is None:
            self.response_ids = ResponseIds([os.urandom(32)])
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
        self.relay = Relay(self.upstream, self.metrics, self.clock, self.response_ids)
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
        status = 0

        async def tracked(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
            await send(message)

        if path == _MODELS or path == "/healthz":
            await self._plain(scope, tracked, path, method)
            return
        found = families.match(method, path)
        family = found.family
        t0 = self.clock()
        try:
            if isinstance(found, Miss):
                raise GatewayError(
                    found.status, found.message, type_="invalid_request_error", code=found.code
                )
            if found.route.operation != "create":
                await self._stored(scope, receive, tracked, found)
            else:
                await self._generate(scope, receive, tracked, found)
        except GatewayError as exc:
            if started:
                raise
            headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
            if isinstance(found, Miss) and found.allow:
                headers.append((b"allow", found.allow.encode()))
            body = anthropic_body(exc) if family and family.errors == "anthropic" else exc.body()
            await send_json(tracked, exc.status, body, headers)
        except ClientGone:
            status = 499  # nginx's: the client closed the connection before the answer
        finally:
            api = family.api if family is not None else "_unknown"
            self.metrics.api_request(api, status or 500, self.clock() - t0)

    async def _plain(self, scope: Scope, send: Send, path: str, method: str) -> None:
        """/v1/models and /healthz: no body, no model, nothing routed."""
        try:
            if path == "/healthz":
                await send_json(send, 200, b'{"status":"ok"}')
                return
            if method not in ("GET", "HEAD"):
                raise GatewayError(
                    405,
                    f"{method} is not allowed on {path}; allowed: GET",
                    type_="invalid_request_error",
                    code="method_not_allowed",
                )
            await self._models(scope, send)
        except GatewayError as exc:
            headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
            if exc.status == 405:
                headers.append((b"allow", b"GET"))
            await send_json(send, exc.status, exc.body(), headers)

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

    async def _generate(self, scope: Scope, receive: Receive, send: Send, found: Match) -> None:
        asked = await self._parse(scope, receive, found)
        admission = self._admit(asked)
        flow = self.flow
        model = asked.model
        granted = sending = False
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
            flow.sending(model)
            sending = True
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
            if sending:
                flow.done(model)
            admission.release()
            # A replica's slot freed (or a grant came back): the next queued request goes.
            flow.dispatch()

    async def _stored(self, scope: Scope, receive: Receive, send: Send, found: Match) -> None:
        """``GET /v1/responses/{id}`` and its cancel: to the replica the id names, which alone
        stores the response (no lookup: the id is signed, ``apis.response_ids``), never to
        another; nothing to route, admit or account."""
        key = self._authenticate(scope, found.family)
        if found.route.method == "POST":
            await self._read_raw(scope, receive)  # a cancel's body, if any, is not read further
        assert self.response_ids is not None and found.response_id is not None
        try:
            ref = self.response_ids.unwrap(found.response_id, scope=key.key_id)
        except ResponseIdRefused as exc:
            raise GatewayError(
                404, exc.message, type_="invalid_request_error", code="response_not_found",
                param="response_id",
            ) from None  # fmt: skip
        allowed = key.allowed_models
        served = [
            (name, route)
            for name, route in self.routes.table.routes.items()
            if (allowed is None or name in allowed)
            and any(ep.replica == ref.replica for ep in route.endpoints)
        ]
        if not served:
            raise _stored_gone(ref.replica, param="response_id")
        route = served[0][1]
        ep = next(ep for ep in route.endpoints if ep.replica == ref.replica)
        if ref.restarted(ep.incarnation):
            raise _stored_gone(ref.replica, param="response_id", restarted=True)
        upstream, metrics = self.upstream, self.metrics
        metrics.in_flight.inc()
        try:
            attempt = await upstream.send(
                route,
                ref.replica,
                b"",
                families.engine_path(found.route, ref.engine_id),
                prefill=0.0,
                prompt_tokens=0,
                method=found.route.method,
                pinned=True,
            )
        except BaseException:
            metrics.in_flight.dec()
            raise
        try:
            await self.relay.whole(
                attempt, send, _NOTHING_TO_SETTLE, route, self.clock(), api="responses",
                scope=key.key_id,
            )  # fmt: skip
        finally:
            upstream.ended(attempt.ep.replica, attempt.prefill, attempt.claim)
            metrics.in_flight.dec()
            attempt.resp.release()

    def _authenticate(self, scope: Scope, family: Family) -> K:
        """The key, from ``Authorization`` (or, on Anthropic's routes, ``x-api-key``), before
        any byte of the body is read."""
        x_api_key = header(scope, b"x-api-key") if family.x_api_key else None
        return self.authenticate(
            families.credential(family, header(scope, b"authorization"), x_api_key)
        )

    async def _parse(self, scope: Scope, receive: Receive, found: Match) -> _Asked[K]:
        """The request, authenticated and read; a ``GatewayError`` for a request that names
        no model it may use, or one no replica serves and none will."""
        started = self.clock()
        family = found.family
        api = family.api
        key = self._authenticate(scope, family)
        body, size = await self._read_json(scope, receive)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("`model` is required: a name from GET /v1/models", param="model")
        pinned: EngineRef | None = None
        routed_body = body
        chat = api in _CHAT_SHAPED
        try:
            # Before anything reads the body: the fields it acts on become the engine's values.
            if api in ("chat", "completions"):
                canonicalize(body, chat=chat)
                prompt = prompt_of(body, chat=chat)
            elif api in ("responses", "messages", "count_tokens"):
                if api == "responses":
                    assert self.response_ids is not None
                    pinned = self.response_ids.for_engine(body, scope=key.key_id)
                    prompts.canonicalize(api, body)
                    routed_body = prompts.responses_chat(body).body
                else:
                    if api == "messages":
                        prompts.canonicalize(api, body)
                    routed_body = prompts.messages_chat(body).body
                messages = routed_body.get("messages")
                prompt = prompt_of(routed_body, chat=True) if messages else Prompt("", False)
            else:  # pooling: balanced by load, its input only counted
                prompt = Prompt(_pooled_text(body), False)
        except prompts.Refused as exc:
            raise bad_request(exc.message, param=exc.field) from None
        except ResponseIdRefused as exc:
            raise GatewayError(
                404, exc.message, type_="invalid_request_error", code="response_not_found",
                param=exc.field,
            ) from None  # fmt: skip
        allowed = key.allowed_models
        route = self.table.route(model)
        if route is None and (allowed is None or model in allowed):
            # Declared a moment ago (an adapter applied, then asked for at once) and its NOTIFY
            # not read yet: one fresh read before the 404 (shared and spaced by the cache).
            await self.routes.catch_up()
            route = self.table.route(model)
        if route is None or (allowed is not None and model not in allowed):
            self.metrics.inc(self.metrics.requests, "_unknown", "", "404")
            adapters = self.table.current().adapters
            hint = unknown_model_hint(
                model, adapters, lambda name: allowed is None or name in allowed
            )
            raise GatewayError.model_not_found(model, hint)
        if family.group not in route.apis:
            raise GatewayError(
                404,
                f"the model {model!r} does not serve {found.route}: it serves "
                f"{families.routes_of(route.apis)} (its profile's `apis`)",
                type_="invalid_request_error",
                code="unsupported_api",
                param="model",
            )
        if not route.endpoints and not route.wakeable:  # wakeable: held, flow.py
            self.metrics.inc(self.metrics.requests, model, "", "503")
            raise GatewayError.no_ready_replica(model)
        stream = bool(body.get("stream")) and family.generates
        if key.cache_salt:
            # The key's salt wins over anything the client sent: tenant isolation is the
            # operator's rule, not the client's choice.
            body["cache_salt"] = key.cache_salt
            if routed_body is not body:
                routed_body["cache_salt"] = key.cache_salt
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        return _Asked(
            started=started,
            path=families.engine_path(found.route),
            match=found,
            chat=chat,
            key=key,
            body=body,
            size=size,
            model=model,
            route=route,
            prompt=prompt,
            estimate=len(prompt.text) // CHARS_PER_TOKEN,
            stream=stream,
            client_usage=ask_for_usage(body)
            if stream and api in ("chat", "completions")
            else False,
            salt=salt,
            session=session_of(header(scope, b"x-session-id"), body),
            routed_body=routed_body,
            pinned=pinned,
        )

    def _admit(self, asked: _Asked[K]) -> Charged:
        """The key's admission of the request's tokens (its prompt, estimated, and what it may
        generate), or the ``GatewayError`` (429) of the limit it would break."""
        limit = self.load.context_limit(ep.replica for ep in asked.route.endpoints)
        api = asked.family.api
        if api in ("chat", "completions"):
            reserve = reserve_tokens(
                asked.body,
                api == "chat",
                self.settings,
                context_limit=limit,
                prompt_tokens=asked.estimate,
            )
        else:
            wanted = prompts.reserve(api, asked.body)
            if wanted is None:  # the engine's default: the context left, as for chat
                wanted = (
                    max(1, limit - asked.estimate)
                    if limit is not None
                    else self.settings.default_max_tokens
                )
            reserve = wanted
        admitted = self.admit(asked.key, asked.model, asked.estimate + reserve)
        return Charged(admitted, self.flow, asked.model, asked.key.key_id, reserved_output=reserve)

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
        if asked.pinned is not None:
            candidates = [ep for ep in route.endpoints if ep.replica == asked.pinned.replica]
            if not candidates:
                raise _stored_gone(asked.pinned.replica)
            if asked.pinned.restarted(candidates[0].incarnation):
                raise _stored_gone(asked.pinned.replica, restarted=True)
        else:
            candidates = flow.with_room(upstream.candidates(route, exclude=()))
        chosen = await self.router.route(
            route,
            candidates,
            asked.routed_body,
            asked.prompt,
            chat=asked.chat,
            salt=asked.salt,
            session=asked.session,
            estimate=asked.estimate,
            by_prefix=asked.match.generates and asked.pinned is None,
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
                pinned=asked.pinned is not None,
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
            api, scope = asked.family.api, asked.key.key_id
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
                    api=api,
                    scope=scope,
                )
            else:
                await self.relay.whole(
                    attempt,
                    send,
                    admission,
                    route,
                    asked.started,
                    api=api,
                    scope=scope,
                    running_charge=(chosen.prompt_tokens, admission.reserved_output),
                )
        finally:
            self.upstream.ended(attempt.ep.replica, attempt.prefill, attempt.claim)
            self.metrics.in_flight.dec()
            attempt.resp.release()

    async def _read_raw(self, scope: Scope, receive: Receive) -> bytes:
        """The body's bytes, capped (``gateway.max_body_bytes``)."""
        cap = self.settings.max_body_bytes
        try:
            declared = declared_length(header(scope, b"content-length"))
            return await read_asgi(receive, cap, declared)
        except BodyTooLarge:
            raise body_too_large(cap, "gateway.max_body_bytes") from None
        except BadContentLength:
            raise bad_request("Content-Length is not a number", code="invalid_header") from None

    async def _read_json(self, scope: Scope, receive: Receive) -> tuple[dict[str, Any], int]:
        """The body as a JSON object, and its size in bytes."""
        raw = await self._read_raw(scope, receive)
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


def _pooled_text(body: Mapping[str, Any]) -> str:
    """A pooling request's input as text, for its estimate: ``input`` (embeddings), ``query``
    and ``documents`` (rerank), ``text_1`` and ``text_2`` (score); strings only, the rest
    counted by the engine."""
    parts: list[str] = []
    for name in ("input", "query", "documents", "text_1", "text_2"):
        value = body.get(name)
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(v for v in value if isinstance(v, str))
    return "\n".join(parts)


class _NothingToSettle:
    """A stored response's retrieve or cancel: no tokens were admitted, none are settled."""

    def settle(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        return None

    def release(self) -> None:
        return None


_NOTHING_TO_SETTLE: Final = _NothingToSettle()


def _stored_gone(
    replica: str, *, param: str = "previous_response_id", restarted: bool = False
) -> GatewayError:
    """404: the replica storing the response no longer serves, or (``restarted``) serves from
    a new engine process, which holds none of the old one's responses (they live in memory)."""
    why = (
        "whose engine has restarted since; its stored responses are gone with the old process"
        if restarted
        else "which no longer serves (stopped, replaced or not ready); its stored responses "
        "are gone with it"
    )
    return GatewayError(
        404,
        f"the response was stored by replica {replica}, {why}: start the conversation again "
        "without previous_response_id",
        type_="invalid_request_error",
        code="response_replica_restarted" if restarted else "response_replica_gone",
        param=param,
    )
