"""The two servers bench/gateway.py measures the gateway against, as raw ASGI apps under uvicorn.

``canned``: an OpenAI upstream that answers every completion with the same text, streamed as
``--chunks`` SSE chunks (optionally ``--chunk-interval-ms`` apart) or as one JSON body. It
costs next to nothing per request, so what a bench measures in front of it is the proxy. It
also answers what the gateway asks of an engine through an agent's proxy: ``/health``,
``/metrics`` (vLLM's gauge names, with its real in-flight count, so least-loaded sees load)
and ``/tokenize``. Paths are matched by suffix, so it serves the same answers under the agent
proxy's ``/shards/<id>`` prefix that the control plane hands the gateway as ``proxy_url``.
With ``CANNED_API_KEY`` in its environment (a secret: never on argv) it refuses requests
without ``Authorization: Bearer <key>`` (401), as an engine behind an agent does.

``floor``: the minimal pass-through proxy, the floor any Python gateway is measured against:
the same server stack (uvicorn + uvloop + httptools, raw ASGI), one pooled upstream client
(aiohttp by default, ``--client httpx`` to compare), the body forwarded as read and the answer
streamed back chunk by chunk as it arrives. No auth, no parsing, no routing.

    python bench/_servers.py canned --port 9001 --chunks 16
    python bench/_servers.py floor --port 9002 --upstream http://127.0.0.1:9001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["canned_app", "floor_app", "main"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MODEL = "canned"
MAX_BODY = 1 << 20


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise ValueError("request body over 1 MiB")
        parts.append(chunk)
        if not msg.get("more_body"):
            return b"".join(parts)


async def _send(send: Send, status: int, body: bytes, ctype: bytes = b"application/json") -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def canned_app(*, chunks: int, chunk_interval_s: float, key: str) -> App:
    """The canned upstream (see the module docstring)."""
    words = [f" w{i}" for i in range(chunks)]
    text = "".join(words)
    usage = {"prompt_tokens": 12, "completion_tokens": chunks, "total_tokens": 12 + chunks}
    usage_cached = dict(usage, prompt_tokens_details={"cached_tokens": 0})
    auth = f"Bearer {key}".encode()
    state = {"running": 0}

    def _full(chat: bool) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return json.dumps(
            {
                "id": "cmpl-canned",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": MODEL,
                "choices": [choice],
                "usage": usage_cached,
            }
        ).encode()

    def _chunk(chat: bool, piece: str | None, with_usage: bool) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
        if chat:
            choice["delta"] = (
                {"role": "assistant", "content": ""} if piece is None else {"content": piece}
            )
        else:
            choice["text"] = piece or ""
        obj: dict[str, Any] = {
            "id": "cmpl-canned",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [choice],
        }
        if with_usage:
            obj["usage"] = None
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    pre = {
        (chat, u): ([_chunk(chat, None, u)] if chat else []) + [_chunk(chat, w, u) for w in words]
        for chat in (True, False)
        for u in (True, False)
    }
    full = {True: _full(True), False: _full(False)}

    def _usage_chunk(chat: bool) -> bytes:
        obj: dict[str, Any] = {
            "id": "cmpl-canned",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [],
            "usage": usage_cached,
        }
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    usage_chunks = {True: _usage_chunk(True), False: _usage_chunk(False)}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path: str = scope["path"]
        if path.endswith("/health"):
            await _send(send, 200, b"{}")
            return
        if path.endswith("/metrics"):
            n = state["running"]
            body = (
                f'vllm:num_requests_running{{model_name="{MODEL}"}} {n}.0\n'
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
            ).encode()
            await _send(send, 200, body, b"text/plain; version=0.0.4")
            return
        if path.endswith("/v1/models"):
            await _send(
                send,
                200,
                json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode(),
            )
            return
        if key and dict(scope["headers"]).get(b"authorization") != auth:
            await _send(send, 401, b'{"error":{"message":"bad key","type":"auth","code":401}}')
            return
        if path.endswith("/tokenize"):
            await _read_body(receive)
            await _send(send, 200, b'{"tokens":[1,2,3,4,5,6,7,8,9,10,11,12],"count":12}')
            return
        chat = path.endswith("/chat/completions")
        if not chat and not path.endswith("/completions"):
            await _send(send, 404, b'{"error":{"message":"no such route","code":404}}')
            return
        req = json.loads(await _read_body(receive))
        state["running"] += 1
        try:
            if not req.get("stream"):
                await _send(send, 200, full[chat])
                return
            with_usage = bool((req.get("stream_options") or {}).get("include_usage"))
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for piece in pre[(chat, with_usage)]:
                if chunk_interval_s:
                    await asyncio.sleep(chunk_interval_s)
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            tail = (usage_chunks[chat] if with_usage else b"") + b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": tail})
        finally:
            state["running"] -= 1

    return app


_HOP = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"})


def floor_app(*, upstream: str, client: str) -> App:
    """The pass-through floor (see the module docstring)."""
    holder: dict[str, Any] = {}

    async def _startup() -> None:
        if client == "aiohttp":
            import aiohttp

            holder["c"] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, ttl_dns_cache=None),
                timeout=aiohttp.ClientTimeout(total=None),
                auto_decompress=False,
            )
        else:
            import httpx

            holder["c"] = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
                timeout=None,
            )

    async def _shutdown() -> None:
        c = holder.get("c")
        if c is not None:
            await (c.close() if client == "aiohttp" else c.aclose())

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await _startup()
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await _shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = await _read_body(receive)
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k not in _HOP}
        url = upstream + scope["path"]
        c = holder["c"]
        if client == "aiohttp":
            async with c.request(scope["method"], url, data=body, headers=headers) as resp:
                await send(
                    {
                        "type": "http.response.start",
                        "status": resp.status,
                        "headers": [
                            (b"content-type", resp.headers.get("content-type", "").encode())
                        ],
                    }
                )
                async for chunk in resp.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            return
        req = c.build_request(scope["method"], url, content=body, headers=headers)
        resp = await c.send(req, stream=True)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status_code,
                    "headers": [(b"content-type", resp.headers.get("content-type", "").encode())],
                }
            )
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await resp.aclose()

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="canned upstream / floor proxy for bench/")
    sub = parser.add_subparsers(dest="kind", required=True)
    c = sub.add_parser("canned")
    c.add_argument("--chunks", type=int, default=16)
    c.add_argument("--chunk-interval-ms", type=float, default=0.0)
    f = sub.add_parser("floor")
    f.add_argument("--upstream", required=True)
    f.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    for p in (c, f):
        p.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    app: App
    if args.kind == "canned":
        app = canned_app(
            chunks=args.chunks,
            chunk_interval_s=args.chunk_interval_ms / 1e3,
            key=os.environ.get("CANNED_API_KEY", ""),
        )
    else:
        app = floor_app(upstream=args.upstream.rstrip("/"), client=args.client)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
