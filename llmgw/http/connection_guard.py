"""The half of the listener bounds both servers share (``llmgw.http.listeners`` holds the
why, and the uvicorn and aiohttp protocols that call these): one listener's open connections,
evictions and head deadlines behind one timer (`ConnectionGuard`), and one connection's head
byte count, deadline and closing answer (`HeadWatch`)."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from llmgw.http.listener_limits import ListenerLimits
from llmgw.logs import get_logger

__all__ = ["ConnectionGuard", "Guarded", "HeadWatch"]

_log = get_logger("llmgw.http.listeners")

# Where the end of a head may be: CRLF CRLF, or the bare LFs lenient parsers accept.
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")
# After a 431 or a 408 what the client still sends is read and dropped for a while before the
# close: closing with unread bytes makes the kernel reset the connection, and the reset can
# destroy the answer before the client reads it (seen with a trickler's next line). Bounded,
# so an endless sender costs a linear read only; a lingering connection still counts against
# the cap. An evicted one does not linger: its descriptor is what the new connection needs.
_LINGER_S = 2.0
_LINGER_BYTES = 4 << 20


class Guarded(Protocol):
    """A connection as the guard sees it: either server's protocol."""

    def evict(self) -> None: ...

    def head_timed_out(self) -> None: ...


class ConnectionGuard:
    """One listener's open connections: the cap; which of them wait for a head, oldest first
    (those a new connection may evict at the cap); and the deadlines of heads under way, in
    deadline order (every head of a listener gets the same timeout), behind one timer."""

    def __init__(self, limits: ListenerLimits) -> None:
        self.limits = limits
        self.open: set[Guarded] = set()
        self._waiting: OrderedDict[Guarded, None] = OrderedDict()
        self._deadlines: OrderedDict[Guarded, float] = OrderedDict()
        self._sweep: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.refused = 0
        self.evicted = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def admit(self, conn: Guarded) -> bool:
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

    def waiting(self, conn: Guarded) -> None:
        """``conn`` waits for its next request's head (evictable, newest)."""
        if conn in self.open:
            self._waiting[conn] = None
            self._waiting.move_to_end(conn)

    def busy(self, conn: Guarded) -> None:
        """``conn``'s head is complete: it is inside a request, not evictable."""
        self._waiting.pop(conn, None)

    def release(self, conn: Guarded) -> None:
        self.open.discard(conn)
        self._waiting.pop(conn, None)
        self._deadlines.pop(conn, None)

    def start_head(self, conn: Guarded) -> None:
        """Start ``conn``'s head deadline, unless it runs already."""
        if conn in self._deadlines or conn not in self.open:
            return
        loop = self.loop
        deadline = loop.time() + self.limits.header_timeout_s
        self._deadlines[conn] = deadline
        if self._sweep is None:
            self._sweep = loop.call_at(deadline, self._expire)

    def end_head(self, conn: Guarded) -> None:
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


class HeadWatch:
    """The per-connection half both servers share: the head's byte count and deadline.

    ``head`` is the bytes of the current request's head received so far, or None while a
    request's head is complete and its body is still arriving.
    """

    __slots__ = ("conn", "done", "guard", "head", "linger", "linger_left", "refused", "tail")

    def __init__(self, guard: ConnectionGuard, conn: Guarded) -> None:
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
