"""RequestLog, the pure ASGI middleware both listeners share: ids, access lines, 5xx, streams.

In-process at the ASGI level, so the tests see exactly what the server would be sent and
when; structlog's capture_logs shows what would be logged.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog
from starlette.types import Message, Receive, Scope, Send
from structlog.testing import capture_logs

from llmgw.http.errors import error_body
from llmgw.http.request_log import RequestLog

pytestmark = pytest.mark.timeout(10)


def _scope(path: str = "/x", headers: list[tuple[bytes, bytes]] | None = None) -> Scope:
    return {"type": "http", "method": "GET", "path": path, "headers": headers or []}


async def _receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _internal(rid: str) -> bytes:
    return error_body("internal", f"internal error; report request id {rid}")


async def test_an_unhandled_error_is_a_logged_500_carrying_the_request_id() -> None:
    async def boom(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("bug")

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    with capture_logs() as logs:
        await RequestLog(boom, listener="internal", internal_error=_internal)(
            _scope(headers=[(b"x-request-id", b"req-42")]), _receive, send
        )
    start, body = sent
    assert start["status"] == 500
    assert (b"x-request-id", b"req-42") in [(k.lower(), v) for k, v in start["headers"]]
    assert "req-42" in json.loads(body["body"])["error"]["message"]
    failed = [e for e in logs if e["event"] == "http_request_failed"]
    access = [e for e in logs if e["event"] == "http_request"]
    assert failed and failed[0]["log_level"] == "error" and failed[0]["exc_info"] is True
    assert access == [
        {
            "event": "http_request",
            "log_level": "error",
            "listener": "internal",
            "method": "GET",
            "path": "/x",
            "status": 500,
            "duration_ms": access[0]["duration_ms"],
        }
    ]


async def test_a_streamed_response_passes_through_unbuffered() -> None:
    first_chunk_out = asyncio.Event()

    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        # Only continues once the first chunk reached the server: a buffering middleware
        # would hold it back, and this would time out.
        await asyncio.wait_for(first_chunk_out.wait(), timeout=5)
        await send({"type": "http.response.body", "body": b"two", "more_body": False})

    bodies: list[bytes] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])
            first_chunk_out.set()

    with capture_logs() as logs:
        await RequestLog(stream, listener="public", internal_error=_internal)(
            _scope(), _receive, send
        )
    assert bodies == [b"one", b"two"]
    assert [e["status"] for e in logs if e["event"] == "http_request"] == [200]


async def test_the_request_id_is_bound_while_the_app_logs() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        structlog.get_logger().info("inside")
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(_message: Message) -> None:
        return None

    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as captured:
        await RequestLog(app, listener="internal", internal_error=_internal)(
            _scope(headers=[(b"x-request-id", b"rid-7")]), _receive, send
        )
    inside = [e for e in captured if e["event"] == "inside"]
    assert inside and inside[0]["request_id"] == "rid-7"
