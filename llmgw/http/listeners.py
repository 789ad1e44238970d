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
import json
import resource
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, _RequestHandler
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from llmgw.logs import get_logger

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

_log = get_logger("llmgw.http.listeners")

DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Descriptors every process keeps apart from its listeners' connections: log files, listening
# sockets, /proc reads, ZMQ sockets, DNS, the database's LISTEN connection. Callers add what
# they know they hold on top (database pools, upstream pools).
FD_RESERVE = 256
# No listener is cut below this by a small descriptor limit: a few connections must get in.
_MIN_CONNECTIONS = 16
# Where the end of a head may be: CRLF CRLF, or the bare LFs lenient parsers accept.
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")
# After a 431 or a 408 what the client still sends is read and dropped for a while before the
# close: closing with unread bytes makes the kernel reset the connection, and the reset can
# destroy the answer before the client reads it (seen with a trickler's next line). Bounded,
# so an endless sender costs a linear read only; a lingering connection still counts against
# the cap. An evicted one does not linger: its descriptor is what the new connection needs.
_LINGER_S = 2.0
_LINGER_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """One listener's bounds, and the settings that set them (named in errors and logs)."""

    listener: str  # "public", "internal", "proxy", "agent-metrics", "simengine"
    max_connections: int
    max_header_bytes: int
    header_timeout_s: float
    connections_setting: str  # e.g. "gateway.max_connections"
    header_bytes_setting: str  # e.g. "gateway.max_header_bytes"
    # Descriptors one connection may hold: 2 for a proxy (the client's and the upstream's).
    fds_per_connection: int = 1

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_header_bytes < 1024 or self.header_timeout_s <= 0:
            raise ValueError(
                f"{self.listener} listener limits out of range: max_connections >= 1, "
                "max_header_bytes >= 1024 and header_timeout_s > 0 are required"
            )


def raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to its hard limit; returns the soft limit now
    in force. Linux's default soft limit (1024) is what ran the agent out of descriptors at a
    few hundred idle connections, while its hard limit was far above."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit cannot be a soft one on Linux (fs.nr_open caps it): 2^20 is its
    # default there.
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return int(soft if soft != resource.RLIM_INFINITY else target)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        _log.warning("fd_limit_not_raised", soft=soft, hard=hard, error=str(exc))
        return int(soft)
    return int(target)


def fit_connections(limits: Sequence[ListenerLimits], *, reserve: int) -> list[ListenerLimits]:
    """``limits`` with each ``max_connections`` lowered, in proportion, so that all listeners'
    connections together plus ``reserve`` fit in the descriptor limit (raised first to the hard
    one): a listener that hit EMFILE would stop accepting, the health check included, and
    writes an error per failed accept."""
    fd_limit = raise_fd_limit()
    wanted = sum(lim.max_connections * lim.fds_per_connection for lim in limits)
    budget = fd_limit - reserve
    if wanted <= budget:
        return list(limits)
    share = max(budget, 0) / wanted
    fitted = [
        replace(lim, max_connections=max(_MIN_CONNECTIONS, int(lim.max_connections * share)))
        for lim in limits
    ]
    _log.warning(
        "connection_caps_lowered_to_fd_limit",
        fd_limit=fd_limit,
        reserve=reserve,
        caps={lim.listener: lim.max_connections for lim in fitted},
        hint="raise the descriptor hard limit (LimitNOFILE= in the systemd unit, ulimit -Hn) "
        "to serve the configured "
        + ", ".join(f"{lim.connections_setting}={lim.max_connections}" for lim in limits),
    )
    return fitted


class _Guarded(Protocol):
    def evict(self) -> None: ...

    def head_timed_out(self) -> None: ...


class ConnectionGuard:
    """One listener's open connections: the cap; which of them wait for a head, oldest first
    (those a new connection may evict at the cap); and the deadlines of heads under way, in
    deadline order (every head of a listener gets the same timeout), behind one timer."""

    def __init__(self, limits: ListenerLimits) -> None:
        self.limits = limits
        self.open: set[_Guarded] = set()
        self._waiting: OrderedDict[_Guarded, None] = OrderedDict()
        self._deadlines: OrderedDict[_Guarded, float] = OrderedDict()
        self._sweep: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.refused = 0
        self.evicted = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def admit(self, conn: _Guarded) -> bool:
        """Count ``conn`` in, evicting the oldest connection waiting for a head at the cap;
        False (refuse it) when every open connection is inside a request."""
        if len(self.open) >= self.limits.max_connections:
            if not self._waiting:
                self.refused += 1
                _log.warning(
                    "listener_connection_refused",
                    listener=self.limits.listener,
                    max_connections=self.limits.max_connections,
                    refused_total=self.refused,
                    hint=f"every connection is inside a request; raise "
                    f"{self.limits.connections_setting} (and the descriptor limit) if the load "
                    "is real",
                )
                return False
            victim, _ = self._waiting.popitem(last=False)
            self.release(victim)
            self.evicted += 1
            _log.warning(
                "listener_connection_evicted",
                listener=self.limits.listener,
                max_connections=self.limits.max_connections,
                evicted_total=self.evicted,
                hint="the listener is at its cap; the oldest connection waiting for a request "
                f"was closed (raise {self.limits.connections_setting} if the clients are real)",
            )
            victim.evict()
        self.open.add(conn)
        self._waiting[conn] = None
        return True

    def waiting(self, conn: _Guarded) -> None:
        """``conn`` waits for its next request's head (evictable, newest)."""
        if conn in self.open:
            self._waiting[conn] = None
            self._waiting.move_to_end(conn)

    def busy(self, conn: _Guarded) -> None:
        """``conn``'s head is complete: it is inside a request, not evictable."""
        self._waiting.pop(conn, None)

    def release(self, conn: _Guarded) -> None:
        self.open.discard(conn)
        self._waiting.pop(conn, None)
        self._deadlines.pop(conn, None)

    def start_head(self, conn: _Guarded) -> None:
        """Start ``conn``'s head deadline, unless it runs already."""
        if conn in self._deadlines or conn not in self.open:
            return
        loop = self.loop
        deadline = loop.time() + self.limits.header_timeout_s
        self._deadlines[conn] = deadline
        if self._sweep is None:
            self._sweep = loop.call_at(deadline, self._expire)

    def end_head(self, conn: _Guarded) -> None:
        self._deadlines.pop(conn, None)

    def _expire(self) -> None:
        # Deadlines were added in time order with one timeout: the expired ones are in front.
        self._sweep = None
        now = self.loop.time()
        while self._deadlines:
            conn, deadline = next(iter(self._deadlines.items()))
            if deadline > now:
                self._sweep = self.loop.call_at(deadline, self._expire)
                return
            del self._deadlines[conn]
            conn.head_timed_out()


def _response(status: int, reason: str, code: str, message: str) -> bytes:
    # OpenAI's error shape, like the gateway's and the proxy's: the public listener's clients
    # are OpenAI SDKs, and the shape reads as well anywhere else.
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    ).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class _HeadWatch:
    """The per-connection half both servers share: the head's byte count and deadline.

    ``head`` is the bytes of the current request's head received so far, or None while a
    request's head is complete and its body is still arriving.
    """

    __slots__ = ("conn", "done", "guard", "head", "linger", "linger_left", "refused", "tail")

    def __init__(self, guard: ConnectionGuard, conn: _Guarded) -> None:
        self.guard = guard
        self.conn = conn
        self.head: int | None = 0
        self.tail = b""  # the head's last bytes so far: its end may straddle two reads
        self.linger: asyncio.TimerHandle | None = None
        self.refused = False
        self.done = False  # answered 431/408 or evicted: what else arrives is dropped
        self.linger_left = 0

    def too_large(self, data: bytes) -> bool:
        """Count ``data`` into the head; True if it takes the head past the cap."""
        assert self.head is not None
        room = self.guard.limits.max_header_bytes - self.head
        if len(data) > room:
            # Past the cap unless the head ends inside it; once past, nothing more is let in.
            if room <= 0:
                return True
            window = self.tail + data[:room]
            if not any(end in window for end in _HEAD_ENDS):
                return True
        self.head += len(data)
        self.tail = data[-3:]
        return False

    def too_large_response(self) -> bytes:
        lim = self.guard.limits
        _log.warning(
            "request_head_too_large", listener=lim.listener, max_header_bytes=lim.max_header_bytes
        )
        return _response(
            431,
            "Request Header Fields Too Large",
            "headers-too-large",
            f"the request line and headers exceed this listener's {lim.max_header_bytes}-byte "
            f"cap; send shorter headers (large values belong in the body), or raise "
            f"{lim.header_bytes_setting} on the server",
        )

    def timed_out_response(self, *, evicted: bool = False) -> bytes | None:
        """What to answer a head that missed its deadline, or was evicted before it was in:
        408 if part of it came, else nothing (the connection was idle)."""
        if not self.head:
            return None
        lim = self.guard.limits
        if not evicted:  # the guard logs evictions itself
            _log.warning(
                "request_head_timed_out",
                listener=lim.listener,
                header_timeout_s=lim.header_timeout_s,
            )
        return _response(
            408,
            "Request Timeout",
            "headers-timeout",
            f"the request line and headers did not arrive within {lim.header_timeout_s:g} s; "
            "send the whole head at once",
        )

    def arm(self) -> None:
        self.guard.start_head(self.conn)

    def received(self, data: bytes) -> bool:
        """Count bytes of a head as they arrive (the first one starts its deadline, if the
        connection's open did not); False if they take it past the cap."""
        if self.head is None:
            return True
        if self.head == 0 and data:
            self.arm()
        return not self.too_large(data)

    def head_complete(self) -> None:
        self.guard.end_head(self.conn)
        self.head = None
        self.guard.busy(self.conn)

    def next_head(self) -> None:
        self.head = 0
        self.tail = b""

    def finish(
        self,
        transport: asyncio.Transport | None,
        response: bytes | None,
        close: Callable[[], None],
        *,
        linger: bool = False,
    ) -> None:
        """Answer ``response`` (if any) and close; with ``linger``, half-close first and read
        what the client still sends for a while (``dropped``), so the answer reaches it. A
        connection answered already (lingering, and evicted now) is closed at once."""
        if self.done:
            if self.linger is not None:
                self.linger.cancel()
                self.linger = None
                close()
            return
        self.done = True
        self.guard.end_head(self.conn)
        if transport is None or transport.is_closing():
            return
        if response is not None:
            transport.write(response)
        if linger and response is not None and transport.can_write_eof():
            transport.write_eof()
            self.linger_left = _LINGER_BYTES
            self.linger = self.guard.loop.call_later(_LINGER_S, close)
        else:
            close()

    def dropped(self, data: bytes) -> bool:
        """``data`` arrived after the answer: True once lingering should end."""
        self.linger_left -= len(data)
        return self.linger_left <= 0

    def lost(self) -> None:
        """The connection is gone: forget it."""
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
        self.guard.release(self.conn)


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
        self._watch = _HeadWatch(self._guard, self)

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
        self._watch = _HeadWatch(guard, self)
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
