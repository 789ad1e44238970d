"""The engine auth proxy: a leader's loopback API, exposed on the management address.

Engines are not a security boundary (docs/architecture.md §6): vLLM leaves /tokenize and /metrics open, and
TensorRT-LLM and Megatron have no authentication at all, so engines bind 127.0.0.1 and are
served at ``http://<mgmt>:<port>/shards/<shard_id>/<path>`` here: by each shard's wrapper, as
its front door with one route (frontdoor.py), and by the agent, for shards adopted from
wrappers too old to serve one (shared_proxy.py). For every request, in this order:

1. the path: only ``/v1/*``, ``/tokenize``, ``/health`` and ``/metrics`` of a known shard, judged
   on the raw (undecoded) path so ``..``, ``%2e%2e`` or ``%2f`` cannot climb out of the shard's
   prefix to an engine's admin routes; anything else is 404, and so are the runtime LoRA routes
   under ``/v1`` (``REFUSED_PATHS``, however encoded), which load whatever path their caller
   names: only the agent calls them, on loopback (adapter_sync.py);
2. ``Authorization: Bearer <that shard's key>``, compared in constant time, before a byte of
   the body is read (401 otherwise): an unauthenticated client cannot make the proxy buffer;
3. the body, capped at ``max_body_bytes`` (413), declared length first, then as it arrives;
4. forwarded to ``127.0.0.1:<upstream_port>`` with the Authorization header kept (the engine
   checks its key too), over a pooled client; the response streams back chunk by chunk as it
   arrives (SSE tokens are not held back), and each write waits for the client to drain, so a
   slow client holds at most the transport's buffer, not the whole answer. An engine that
   could not be reached, or that dropped the request unanswered and no longer listens (a
   kill), is 502 ``upstream-unavailable``, which the gateway retries elsewhere; one that broke
   while it still listens is 502 ``upstream-failed``, which it does not.

aiohttp's low-level server rather than a raw ASGI app under uvicorn: measured (proxy process
CPU, 1500 requests through each to a simulator, 8 concurrent, 2026-11) the two are within ~15%
either way: 0.46 vs 0.39 ms per streamed 32-token completion (uvicorn+httptools ahead), 0.29 vs
0.35 ms per plain one (aiohttp ahead). One framework for both sides of the proxy and no second
server stack decided it. Errors use OpenAI's shape, since the gateway relays them.
The listener runs under ``limits`` (llmgw/http/listeners.py): a head past its cap is answered 431
and one slower than its deadline 408 before step 1, and connections are capped.
This module must NOT log keys or request bodies, nor import the control plane.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from llmgw.http.bodies import BodyTooLarge, read_capped
from llmgw.http.listeners import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    ListenerLimits,
    aiohttp_server,
)
from llmgw.logs import get_logger

__all__ = [
    "ALLOWED_PATHS",
    "DEFAULT_LIMITS",
    "REFUSED_PATHS",
    "EngineProxy",
    "ProxyRoute",
    "proxy_limits",
]

_log = get_logger(__name__)

# Exact paths besides the /v1/ prefix; the gateway needs nothing else of an engine.
ALLOWED_PATHS = frozenset({"/tokenize", "/health", "/metrics"})
# Under /v1/ but never the gateways': vLLM's (and the simulator's) runtime LoRA routes, open on
# engines with adapter_slots (VLLM_ALLOW_RUNTIME_LORA_UPDATING). Compared decoded and in lower
# case: the engine's router decodes %6C to "l" before it matches.
REFUSED_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
_METHODS = frozenset({"GET", "HEAD", "POST"})
# Per RFC 9110 §7.6.1, plus the ones a proxy must not pass on.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Encoded dot, slash or backslash: decoded by some engines' routers after our check.
_ENCODED_TRAVERSAL = re.compile(r"%(2e|2f|5c)", re.IGNORECASE)
_SHARD_SEGMENT = re.compile(r"[A-Za-z0-9._~-]{1,200}")
# An engine on loopback accepts or refuses at once; one that does neither within this is alive
# but stuck, and may hold the request: it counts as listening.
_LISTENING_PROBE_S = 1.0


def proxy_limits(
    *, max_connections: int, max_header_bytes: int, header_timeout_s: float
) -> ListenerLimits:
    """A front door's listener bounds, from the agent's settings of the same names; each
    connection may hold a second one, to its engine."""
    return ListenerLimits(
        listener="proxy",
        max_connections=max_connections,
        max_header_bytes=max_header_bytes,
        header_timeout_s=header_timeout_s,
        connections_setting="agent.proxy_max_connections",
        header_bytes_setting="agent.max_header_bytes",
        fds_per_connection=2,
    )


# What the agent's settings default to (agent.proxy_max_connections, agent.max_header_bytes,
# agent.header_timeout_s).
DEFAULT_LIMITS = proxy_limits(
    max_connections=4096,
    max_header_bytes=DEFAULT_MAX_HEADER_BYTES,
    header_timeout_s=DEFAULT_HEADER_TIMEOUT_S,
)


@dataclass(frozen=True, slots=True)
class ProxyRoute:
    """Where a shard's engine listens on loopback, and the key clients must present."""

    upstream_port: int
    api_key: str = field(repr=False)  # never printed: reprs end up in logs


def _error(status: int, code: str, message: str) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None,
            "code": code,
        }
    }
    return web.Response(status=status, body=json.dumps(body), content_type="application/json")


async def _listening(host: str, port: int) -> bool:
    """False only when a connect to ``host:port`` is refused (nothing listens there); a connect
    that hangs past the probe's bound is taken as a live, stuck listener."""
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port), timeout=_LISTENING_PROBE_S
        )
    except TimeoutError:
        return True
    except OSError:
        return False
    writer.close()
    return True


def split_path(raw_path: str) -> tuple[str, str] | None:
    """``/shards/<id>/<rest>`` -> (id, rest) if ``rest`` is an allowed engine path, else None."""
    path = raw_path.split("?", 1)[0]
    if not path.startswith("/shards/") or "\\" in path or _ENCODED_TRAVERSAL.search(path):
        return None
    shard, sep, rest = path[len("/shards/") :].partition("/")
    if not sep or not _SHARD_SEGMENT.fullmatch(shard) or shard in (".", ".."):
        return None
    rest = "/" + rest
    segments = rest.split("/")[1:]
    if any(s in ("", ".", "..") for s in segments):
        return None
    if rest in ALLOWED_PATHS:
        return shard, rest
    if rest.startswith("/v1/") and len(rest) > len("/v1/"):
        if unquote(rest).lower() in REFUSED_PATHS:
            return None
        return shard, rest
    return None


class EngineProxy:
    """The authenticating reverse proxy in front of every ready leader on this node."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        max_body_bytes: int = 32 * 1024 * 1024,
        upstream_host: str = "127.0.0.1",
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = 600.0,
        metrics_token: str = "",
        limits: ListenerLimits = DEFAULT_LIMITS,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        self._upstream_host = upstream_host
        # No total timeout: a long generation streams for minutes. A read timeout catches an
        # engine that stopped answering mid-stream.
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        # Prometheus scrapes every engine with one credential (http_sd has no per-target
        # secrets): accepted for GET /metrics only, never for anything that runs the model.
        self._metrics_auth = f"Bearer {metrics_token}".encode() if metrics_token else b""
        self._routes: dict[str, ProxyRoute] = {}
        self._runner: web.ServerRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def set_routes(self, routes: Mapping[str, ProxyRoute]) -> None:
        """Replace the served shards (the agent calls it as leaders become ready or go)."""
        self._routes = dict(routes)

    async def start(self) -> int:
        """Listen; returns the bound port (useful with ``port=0``)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=self._timeout,
            auto_decompress=False,  # pass bytes through untouched, Content-Encoding and all
        )
        server = aiohttp_server(self._handle, self.limits)
        self._runner = web.ServerRunner(server, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server_sockets = getattr(site._server, "sockets", None) or []
        if server_sockets:
            self.port = int(server_sockets[0].getsockname()[1])
        _log.info("engine_proxy_listening", host=self.host, port=self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        found = split_path(request.raw_path)
        route = self._routes.get(found[0]) if found is not None else None
        if found is None or route is None:
            return _error(404, "not-found", "no such shard or path on this engine proxy")
        shard, rest = found
        if request.method not in _METHODS:
            return _error(405, "method-not-allowed", f"method {request.method} is not proxied")
        presented = request.headers.get("Authorization", "").encode("utf-8", "replace")
        expected = f"Bearer {route.api_key}".encode()
        scrape = (
            rest == "/metrics"
            and request.method == "GET"
            and bool(self._metrics_auth)
            and hmac.compare_digest(presented, self._metrics_auth)
        )
        if not scrape and not hmac.compare_digest(presented, expected):
            return _error(401, "unauthorized", f"missing or wrong API key for shard {shard}")
        try:
            # aiohttp's parser has already refused a Content-Length that is not a number.
            body = await read_capped(
                request.content.iter_any(), self.max_body_bytes, request.content_length
            )
        except BodyTooLarge:
            return _error(
                413,
                "body-too-large",
                f"request body is larger than the proxy's {self.max_body_bytes}-byte cap",
            )
        return await self._forward(request, shard, route, rest, body)

    async def _forward(
        self, request: web.BaseRequest, shard: str, route: ProxyRoute, rest: str, body: bytes
    ) -> web.StreamResponse:
        assert self._session is not None
        query = request.raw_path.partition("?")[2]
        url = URL(
            f"http://{self._upstream_host}:{route.upstream_port}{rest}"
            + (f"?{query}" if query else ""),
            encoded=True,
        )
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP
        )
        try:
            upstream = await self._session.request(
                request.method,
                url,
                headers=headers,
                data=body if body else None,
                allow_redirects=False,
            )
        except TimeoutError:
            return _error(504, "upstream-timeout", f"engine of shard {shard} did not answer")
        except aiohttp.ClientConnectorError as exc:
            # Never connected: the engine never saw the request, so a gateway may send it to
            # another replica (it retries only on this code).
            _log.warning("engine_proxy_upstream_failed", shard=shard, error=type(exc).__name__)
            return _error(502, "upstream-unavailable", f"engine of shard {shard} is unreachable")
        except aiohttp.ClientError as exc:
            # Connected, then lost before any answer. A pooled keep-alive connection to an
            # engine that was just killed looks like this: the request went out on a socket the
            # dead process had already dropped. If the engine no longer listens, nothing it may
            # have started can still run, so a retry elsewhere cannot run the request twice and
            # the gateway may take it as "never reached" (the fault suite's engine kill saw a
            # stream fail so, 50 ms after the kill). A live engine may have started the work:
            # that must not read as "never reached".
            engine_gone = not await _listening(self._upstream_host, route.upstream_port)
            _log.warning(
                "engine_proxy_upstream_failed",
                shard=shard,
                error=type(exc).__name__,
                engine_listening=not engine_gone,
            )
            if engine_gone:
                return _error(
                    502, "upstream-unavailable", f"engine of shard {shard} is unreachable"
                )
            return _error(502, "upstream-failed", f"engine of shard {shard} failed mid-request")
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_BY_HOP:
                    response.headers.add(key, value)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        except (ConnectionError, aiohttp.ClientError, TimeoutError) as exc:
            # The client went away or the engine broke mid-stream: drop the upstream connection
            # so the engine sees the disconnect and aborts the generation.
            _log.info("engine_proxy_stream_aborted", shard=shard, error=type(exc).__name__)
            upstream.close()
            raise
        finally:
            upstream.release()
