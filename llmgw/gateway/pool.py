"""The gateway's HTTP client to engines (through their agents' proxies): the settings of the one
pooled aiohttp session per process, and the capped read of a small document from an engine.

aiohttp, not httpx, by measurement: 32 concurrent clients POSTing to a canned uvicorn upstream
on a 2-core machine, uvloop, 3,200 requests, twice each: aiohttp served 4,460-4,980 req/s at
64-67 us of client CPU per request; httpx 0.28 served 406-412 req/s at 1,190-1,220 us (its
connection pool dominates under concurrency). bench/gateway.py repeats the comparison as the
floor proxy with each client. aiohttp's response body is a bounded ``StreamReader``
(``read_bufsize``) that stops reading the socket when full, which is the backpressure a slow
streaming client needs: the gateway reads the next chunk from the engine only after the client
took the previous one.

What it must NOT do: follow redirects (a proxy answering 3xx is a fault, not a pointer), or
decompress (bytes pass through as the engine sent them).
"""

from __future__ import annotations

import aiohttp

from llmgw.http import bodies

__all__ = ["READ_BUFSIZE", "create_client", "read_capped"]

# Per response: the most a slow client makes the gateway hold (aiohttp pauses the socket).
READ_BUFSIZE = 64 * 1024


def create_client(
    *, pool_size: int, connect_timeout_s: float, read_timeout_s: float
) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=pool_size,
        limit_per_host=0,
        ttl_dns_cache=300,
        keepalive_timeout=30,
        enable_cleanup_closed=True,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=read_timeout_s
        ),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        read_bufsize=READ_BUFSIZE,
        raise_for_status=False,
    )


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` bytes (read no further): for the
    small documents the gateway reads from an engine itself (metrics, models, tokens, an
    error), where ``resp.read()`` would hold whatever the other side chose to send."""
    try:
        return await bodies.read_capped(
            resp.content.iter_chunked(READ_BUFSIZE), limit, resp.content_length
        )
    except bodies.BodyTooLarge:
        return None
