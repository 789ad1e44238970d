"""What every HTTP listener of llmgw bounds before a request reaches its app: the size of a
request's head, the time it may take to arrive, and how many connections are open.

Every listener: the control plane's two (uvicorn), the shards' front doors (the engine proxy,
served by each shard's wrapper) and the agent's metrics listener (aiohttp), and the
simulator's (uvicorn). Each gets, per connection:

- a cap on the request line plus headers (``max_header_bytes``, 64 KiB by default): past it the
  client gets 431 and the connection is closed, before the parser has buffered more. httptools
  has no cap of its own and joins a header's pieces by concatenation, so an unbounded head cost
  the control plane CPU quadratic in its size (128 MB: 23 s, with every listener of the process
  stalled) and memory besides. Bytes are counted as they arrive, before the parser sees them;
  a head may overshoot by at most the read that carried its end (one socket read);
- a deadline for the head (``header_timeout_s``, 10 s by default), from the connection's open
  or from the first byte of each later request's head: a client that trickles its head is
  answered 408 and closed; one that opened a connection and sent nothing is closed without a
  word (an unsolicited 408 could be read as the answer to a request it is about to send).
  Between requests an idle keep-alive connection is the server's own keep-alive timeout's
  (uvicorn: 5 s; aiohttp: its ``keepalive_timeout``), and the first to go at the cap;
- a cap on open connections per listener (``max_connections``), lowered to what the process's
  descriptor limit allows (``fit_connections``). At the cap, a new connection first evicts the
  oldest connection that is waiting for a head (idle keep-alive or a head still arriving):
  holding many idle or trickling connections then takes nothing from anyone, and an
  operator's health check still gets through. Only when every connection is inside a request
  is the new one refused, by closing it as soon as it is accepted: no read, no parse, no timer,
  its descriptor back at once. A 503 with Retry-After was the alternative; written before the
  request is read, the close that follows can reset the connection and destroy the answer on
  its way (unread request bytes make the kernel send RST), so it would need the connection
  held open until the request came, the descriptor the cap is there to keep free. To a client
  the close reads as a connection that failed before any request was sent.

Cost per request: a few dict operations and one clock read; the deadlines of a listener share
one timer (a timer per request cost ~3 us of ~125 us per request of a trivial app). Measured
on this machine (2 cores): a 128 MB head costs the control plane ~5 ms of CPU instead of 23 s.

What it must not do: read a body (the apps and ``llmgw.http.bodies`` do), or log per connection
without the rate limit ``llmgw.logs`` applies to warnings (a flood would be one line each).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, _RequestHandler
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

# The bounds themselves (`listener_limits`) and the bookkeeping both servers share
# (`connection_guard`) have modules of their own; every listener imports them from here.
from llmgw.http.connection_guard import ConnectionGuard, HeadWatch
from llmgw.http.listener_limits import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    FD_RESERVE,
    ListenerLimits,
    fit_connections,
    raise_fd_limit,
)

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_HEADER_BYTES",
    "FD_RESERVE",
    "ConnectionGuard",
    "ListenerLimits",
    "aiohttp_server",
    "fit_connections",
    "raise_fd_limit",
    "uvicorn_protocol",
]


# --- uvicorn (httptools) -------------------------------------------------------------------


class _GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head cap, the head deadline and the connection
    cap of its listener (``_guard``, set on the subclass ``uvicorn_protocol`` makes)."""

    _guard: ConnectionGuard

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._watch = HeadWatch(self._guard, self)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if not self._guard.admit(self):
            self._watch.refused = True
            self.transport = transport
            transport.close()
            return
        super().connection_made(transport)
        self._watch.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watch.refused:
            return
        self._watch.lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        watch = self._watch
        if watch.done:
            if watch.dropped(data):
                self.transport.close()
            return
        if not watch.received(data):
            self._close_with(watch.too_large_response(), linger=True)
            return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._watch.head_complete()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._watch.next_head()
        if not self._responding():
            self._guard.waiting(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._watch.head is not None and not self._responding():
            self._guard.waiting(self)

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def evict(self) -> None:
        self._close_with(self._watch.timed_out_response(evicted=True))

    def head_timed_out(self) -> None:
        if self._watch.head is None or self._watch.done:
            return
        if self._responding():
            # A head pipelined behind a response still streaming: never write into that
            # response; its deadline runs on once the response is over.
            self._watch.arm()
            return
        self._close_with(self._watch.timed_out_response(), linger=True)

    def _close_with(self, response: bytes | None, *, linger: bool = False) -> None:
        self._watch.finish(self.transport, response, self.transport.close, linger=linger)


def uvicorn_protocol(limits: ListenerLimits) -> type[HttpToolsProtocol]:
    """The protocol class for one uvicorn listener (``uvicorn.Config(http=...)``): one class
    per listener, since the class carries the listener's guard."""
    return type(
        "GuardedHttpToolsProtocol", (_GuardedHttpTools,), {"_guard": ConnectionGuard(limits)}
    )


# --- aiohttp -------------------------------------------------------------------------------


class _GuardedRequestHandler(RequestHandler):
    """aiohttp's connection handler with the same bounds. aiohttp's parser caps each line
    and field itself (400 past them); those caps are set to the head's, so this count is the
    one limit, answered 431 like the uvicorn listeners'."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        cap = guard.limits.max_header_bytes
        super().__init__(
            manager,
            max_line_size=cap,
            max_field_size=cap,
            # The byte cap binds first: no header line is shorter than 4 bytes.
            max_headers=cap // 4,
            **kwargs,
        )
        self._watch = HeadWatch(guard, self)
        self._payload: Any = None  # the newest request's body stream, once its head is in

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._watch.guard.admit(self):
            self._watch.refused = True
            transport.close()
            return
        super().connection_made(transport)
        self._watch.arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._watch.refused:
            return
        self._watch.lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        watch = self._watch
        if watch.done:
            if watch.dropped(data):
                self.force_close()
            return
        self._body_done()
        if not watch.received(data):
            self._close_with(watch.too_large_response(), linger=True)
            return
        count = self._request_count
        super().data_received(data)
        if self._request_count != count and self._messages:
            watch.head_complete()
            self._payload = self._messages[-1][1]
            self._body_done()

    async def _handle_request(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super()._handle_request(*args, **kwargs)
        finally:
            self._body_done()

    def _body_done(self) -> None:
        """Once the newest request's body is in, count what comes as the next head; once no
        request is handled or queued either, the connection is idle (evictable)."""
        watch = self._watch
        if watch.head is None and self._payload is not None and self._payload.is_eof():
            watch.next_head()
        if watch.head is not None and not self._responding():
            watch.guard.waiting(self)

    def _responding(self) -> bool:
        return self._request_in_progress or bool(self._messages)

    def evict(self) -> None:
        self._close_with(self._watch.timed_out_response(evicted=True))

    def head_timed_out(self) -> None:
        if self._watch.head is None or self._watch.done:
            return
        if self._responding():  # see _GuardedHttpTools.head_timed_out
            self._watch.arm()
            return
        self._close_with(self._watch.timed_out_response(), linger=True)

    def _close_with(self, response: bytes | None, *, linger: bool = False) -> None:
        self._watch.finish(self.transport, response, self.force_close, linger=linger)


class _GuardedServer(web.Server):
    def __init__(self, handler: _RequestHandler, *, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(handler, **kwargs)
        self._guard = guard

    def __call__(self) -> RequestHandler:
        return _GuardedRequestHandler(self, guard=self._guard, loop=self._loop, **self._kwargs)


def aiohttp_server(handler: _RequestHandler, limits: ListenerLimits, **kwargs: Any) -> web.Server:
    """A low-level aiohttp server (for ``web.ServerRunner``) under ``limits``."""
    return _GuardedServer(handler, guard=ConnectionGuard(limits), **kwargs)
