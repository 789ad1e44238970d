"""Relaying a replica's answer to the client: whole, or as a stream passed through chunk by
chunk; settling what it used; and watching the client for a disconnect.

Streams pass through as the engine sends them: each read from the engine is forwarded before
the next read; uvicorn's ``send`` waits while the client's socket buffer is over its high-water
mark (64 KiB) and aiohttp stops reading the engine's socket when its own bounded buffer is full,
so a slow client holds at most a few hundred KiB here and slows the connection to the engine
instead (backpressure, not accumulation). The gateway always asks the engine for usage on
streams (``stream_options.include_usage``) and the relay drops the usage chunk when the client
did not ask for it. A client that disconnects mid-stream is settled for what was streamed (the
usage if it arrived, else one completion token per streamed chunk). A failure after the headers
went out ends the stream with an error event in OpenAI's shape.

What it must NOT do: buffer a stream, or send a second response start (an error once the
headers went out is an event of the stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from starlette.types import Receive, Send

from llmgw.errors import clip
from llmgw.gateway.apis import usage as api_usage
from llmgw.gateway.apis.anthropic_errors import anthropic_sse_error
from llmgw.gateway.apis.families import ApiName
from llmgw.gateway.apis.response_ids import ResponseIds
from llmgw.gateway.errors import engine_error, sse_error_event, upstream_failed
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routes import Endpoint, ModelRoute
from llmgw.gateway.upstream import Attempt, Upstream, engine_said
from llmgw.gateway.wire import (
    Settleable,
    StreamState,
    filter_events,
    settle,
    usage_of,
    wait_disconnect,
)
from llmgw.logs import get_logger

__all__ = ["DisconnectWatch", "Relay"]

# Reads one read's complete events of a stream: counts and captures into the state, returns
# what goes to the client (``wire.filter_events``' signature).
_Reader = Callable[[bytes, StreamState, bool, Callable[[], float]], bytes]

log = get_logger("llmgw.gateway")


class DisconnectWatch:
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
        # Not awaited: the answer is complete, and waiting would let the server's report of
        # a disconnect reach the watcher first (and cancel the request's task).
        self._watcher.cancel()


class Relay:
    """Sends an ``Attempt``'s answer to the client, counting it in the metrics and, for a
    failure, on the replica (``upstream.failed``)."""

    def __init__(
        self,
        upstream: Upstream,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        response_ids: ResponseIds | None = None,
    ) -> None:
        self._upstream = upstream
        self._metrics = metrics
        self._clock = clock
        self._ids = response_ids

    async def whole(
        self,
        attempt: Attempt,
        send: Send,
        admission: Settleable,
        route: ModelRoute,
        t0: float,
        *,
        api: ApiName = "chat",
        scope: str = "",
        running_charge: tuple[int, int] = (0, 0),
    ) -> None:
        """A non-streamed answer (or a stream's refusal), passed on as the replica sent it; a
        5xx becomes the gateway's 502: ``engine_error`` (not to retry) when the engine itself
        answered it, ``upstream_error`` when it failed on the way (``upstream.engine_said``).
        ``running_charge``: (prompt, output) tokens charged for a Responses answer that is a
        response still running (``background: true``), whose usage no answer will carry: the
        key pays its reservation, as it would for a stream it walked away from."""
        resp, ep = attempt.resp, attempt.ep
        metrics = self._metrics
        try:
            raw = attempt.body if attempt.body is not None else await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._upstream.failed(route, ep, "midstream")
            raise upstream_failed(route.name, f"reading the answer: {type(exc).__name__}") from None
        status = resp.status
        if status >= 500:
            self._upstream.failed(route, ep, "status")
            metrics.inc(metrics.requests, route.name, ep.replica, "502")
            said = engine_said(status, raw)
            if said is None:
                raise upstream_failed(route.name, f"the replica answered {status}")
            # The engine ran the request and failed on it: a warning (the operator may want
            # to know which requests an engine cannot serve), not the retry advice.
            log.warning("gateway_engine_error", model=route.name, replica=ep.replica,
                        status=status, message=clip(said))  # fmt: skip
            raise engine_error(route.name, status, said)
        usage = _usage_of(api, raw) if status == 200 else None
        prompt, output = 0, 0
        if usage is None and api == "responses" and status == 200 and api_usage.still_running(raw):
            prompt, output = running_charge
            log.info("gateway_background_response_charged", model=route.name,
                     replica=ep.replica, prompt_tokens=prompt, completion_tokens=output)  # fmt: skip
        settle(admission, usage, completion_fallback=output, prompt_fallback=prompt)
        if api == "responses" and status == 200 and self._ids is not None:
            # The engine's response ids become ones that name this replica (apis.response_ids).
            raw = self._ids.rewrite_answer(raw, ep.replica, scope=scope, incarnation=ep.incarnation)
        ctype = resp.headers.get("Content-Type", "application/json").encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(raw)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": raw})
        metrics.inc(metrics.requests, route.name, ep.replica, str(status))
        metrics.observe(metrics.request_seconds, self._clock() - t0, route.name, ep.replica)

    async def stream(
        self,
        attempt: Attempt,
        send: Send,
        watch: DisconnectWatch,
        admission: Settleable,
        route: ModelRoute,
        client_usage: bool,
        prompt_tokens: int,
        t0: float,
        *,
        api: ApiName = "chat",
        scope: str = "",
    ) -> None:
        """A 200 stream, event by event; settled on any end, a client's disconnect included."""
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
            await self._pump(attempt, send, state, client_usage, route, api, scope)
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
        metrics = self._metrics
        labels = (route.name, ep.replica)
        metrics.inc(metrics.requests, *labels, "200")
        metrics.observe(metrics.request_seconds, self._clock() - t0, *labels)
        if state.first_at is not None:
            metrics.observe(metrics.ttft_seconds, state.first_at - t0, *labels)

    async def _pump(
        self,
        attempt: Attempt,
        send: Send,
        state: StreamState,
        client_usage: bool,
        route: ModelRoute,
        api: ApiName,
        scope: str,
    ) -> None:
        resp, ep = attempt.resp, attempt.ep
        clock = self._clock
        pending = b""
        read = self._reader(api, ep, scope)
        try:
            async for data in resp.content.iter_any():
                pending += data
                cut = pending.rfind(b"\n\n")
                if cut < 0:
                    continue
                events, pending = pending[: cut + 2], pending[cut + 2 :]
                out = read(events, state, client_usage, clock)
                if state.first_at is not None and (attempt.prefill or attempt.claim):
                    # The first token: this prompt's prefill no longer queues anyone, and
                    # its blocks are on their way to the index.
                    self._upstream.computed(ep.replica, attempt.prefill, attempt.claim)
                    attempt.prefill, attempt.claim = 0.0, None
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._upstream.failed(route, ep, "midstream")
            log.warning("gateway_stream_failed", model=route.name, replica=ep.replica,
                        error=type(exc).__name__)  # fmt: skip
            message = (
                f"the replica serving {route.name!r} failed mid-stream "
                f"({type(exc).__name__}); the answer is incomplete"
            )
            if api == "messages":
                error = anthropic_sse_error(502, message)
            else:
                error = sse_error_event(message, type_="api_error", code="upstream_error")
            await send({"type": "http.response.body", "body": error, "more_body": True})
        else:
            if pending.strip():
                out = read(pending, state, client_usage, clock)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _reader(self, api: ApiName, ep: Endpoint, scope: str) -> _Reader:
        """How a stream of ``api`` is read: chat's and completions' chunks (``wire``), or
        the family's own events (``apis.usage``), a Responses stream's ids wrapped."""
        if api in ("chat", "completions"):
            return filter_events
        reader = api_usage.stream_reader(api)
        ids = self._ids
        if api != "responses" or ids is None:
            return reader

        def responses(
            events: bytes, state: StreamState, client_usage: bool, clock: Callable[[], float]
        ) -> bytes:
            return ids.rewrite_events(
                reader(events, state, client_usage, clock),
                ep.replica,
                scope=scope,
                incarnation=ep.incarnation,
            )

        return responses


def _usage_of(api: ApiName, raw: bytes) -> Mapping[str, Any] | None:
    """A whole answer's usage in the chat shape ``settle`` reads."""
    if api in ("chat", "completions"):
        return usage_of(raw)
    found = api_usage.usage_of(api, raw)
    return found.as_openai() if found is not None else None
