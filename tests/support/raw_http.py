"""HTTP at the socket level, for tests of what a listener does before a request is parsed:
oversized heads, trickled heads, idle and refused connections. Every call has a deadline."""

from __future__ import annotations

import contextlib
import socket
import time

__all__ = ["closed_within", "connect", "exchange", "status"]


def connect(port: int, *, timeout_s: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """What the server sends until it closes (or the deadline passes, or it resets)."""
    out = bytearray()
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not data:
            break
        out += data
    return bytes(out)


def exchange(port: int, head: bytes, *, timeout_s: float = 10.0) -> bytes:
    """Send ``head`` on a new connection and return everything answered until the close. A
    server that stops reading mid-send (it answered already) is not an error."""
    deadline = time.monotonic() + timeout_s
    with connect(port, timeout_s=timeout_s) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)
        return _read_until_closed(sock, deadline)


def closed_within(sock: socket.socket, timeout_s: float) -> tuple[bool, bytes]:
    """Whether the server closed ``sock`` within ``timeout_s``, and what it sent meanwhile
    (an answer may come in one call and the close in the next)."""
    deadline = time.monotonic() + timeout_s
    out = bytearray()
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return False, bytes(out)
        except ConnectionResetError:
            return True, bytes(out)
        if not data:
            return True, bytes(out)
        out += data
    return False, bytes(out)


def status(response: bytes) -> int | None:
    """The status code of the first response in ``response``, None if there is none."""
    if not response.startswith(b"HTTP/1."):
        return None
    return int(response.split(b" ", 2)[1])
