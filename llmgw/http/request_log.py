"""Request ids and the access log, as a pure ASGI middleware.

Every request gets an id (the client's ``X-Request-ID`` when it is a sane token,
else a fresh one), returned in ``X-Request-ID``, bound to structlog's
contextvars for every line logged while serving it, and one ``http_request``
line when it ends, with status and duration. A 5xx is logged at error level
with the id, so a client's report ("request 3f2a… failed") finds its line; but
a 503 at warning: it says the fleet is out of capacity for now (shed, no
replica, the database away), a state an operator watches, not a bug. The
answers on ``quiet_paths`` that succeed log at debug: an agent's sync every
2 s is routine, and its state changes have their own info lines.

What it must not do: buffer a response (it only watches ``http.response.start``
go by, so a token stream passes through untouched), or let an exception leave
without a logged line and a reply: an unhandled error becomes a 500 in the
listener's own error shape naming the request id, never a bare traceback page.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Collection

import structlog
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["RequestLog"]

log = structlog.get_logger("llmgw.http")

# A client-chosen id goes into every log line of its request: only short, plain tokens, so a
# header cannot forge log fields or flood the log.
_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


# Request ids are not secrets, only unique enough to find one request's lines: a PRNG seeded
# once, not a system call per request.
_ids = random.Random()


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            given: str = value.decode("latin-1")
            if _CLIENT_ID_RE.match(given):
                return given
            break
    return f"{_ids.getrandbits(64):016x}"


class RequestLog:
    """``internal_error(request_id) -> body bytes`` renders the listener's 500 body."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        listener: str,
        internal_error: Callable[[str], bytes],
        quiet_paths: Collection[str] = (),
    ) -> None:
        self.app = app
        self.listener = listener
        self.internal_error = internal_error
        self.quiet_paths = frozenset(quiet_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = rid
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                MutableHeaders(scope=message)["X-Request-ID"] = rid
            await send(message)

        start = time.perf_counter()
        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                await self.app(scope, receive, send_with_id)
            except Exception:
                # exc_info: the traceback is the bug report; the request's body is not in it.
                log.error("http_request_failed", listener=self.listener, exc_info=True)
                if status:  # headers are out: all we can do is cut the connection
                    self._access_line(scope, status, start)
                    raise
                body = self.internal_error(rid)
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
            self._access_line(scope, status, start)

    def _access_line(self, scope: Scope, status: int, start: float) -> None:
        fields = {
            "listener": self.listener,
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "duration_ms": round((time.perf_counter() - start) * 1000, 2),
        }
        if status == 503:
            log.warning("http_request", **fields)
        elif status >= 500:
            log.error("http_request", **fields)
        elif status < 400 and scope["path"] in self.quiet_paths:
            log.debug("http_request", **fields)
        else:
            log.info("http_request", **fields)
