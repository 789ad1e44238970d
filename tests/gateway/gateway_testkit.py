"""The gateway app served for real (uvicorn on loopback, in a thread) against real simulator
processes, with a fixed route table and stand-ins for keys and limits, so the request path is
tested without a control plane. The real-system tests (test_gateway_e2e.py) use the real ones.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.config import GatewaySettings
from llmgw.gateway.app import Gateway, RouteSource, TokenizerSource
from llmgw.gateway.errors import GatewayError, internal_error
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.http.request_log import RequestLog
from llmgw.kv.shard_views import ShardViews
from llmgw.store.credentials import parse_api_key
from tests.support.procs import free_port
from tests.support.waiting import wait_for

__all__ = [
    "Key",
    "Served",
    "Settled",
    "StandInLimits",
    "StaticRoutes",
    "endpoint",
    "serve_asgi",
    "serve_gateway",
]

SIM_KEY = "sim-engine-key"


@dataclass(frozen=True)
class Key:
    key_id: str
    name: str
    allowed_models: frozenset[str] | None = None
    cache_salt: str | None = None


@dataclass
class Settled:
    key: str
    model: str
    reserve: int
    settled: list[tuple[int, int, int]] = field(default_factory=list)
    released: bool = False


class StandInAdmission:
    def __init__(self, record: Settled) -> None:
        self.record = record

    def settle(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.record.settled.append((prompt_tokens, completion_tokens, cached_tokens))

    def release(self) -> None:
        self.record.released = True


class StandInLimits:
    """Admits everything but the key named "limited" (429 with Retry-After); records all."""

    def __init__(self) -> None:
        self.admissions: list[Settled] = []

    def admit(self, key: Key, model: str, reserve_tokens: int) -> StandInAdmission:
        if key.name == "limited":
            raise GatewayError.rate_limited("requests per minute (rpm 1)", 7.2)
        record = Settled(key.name, model, reserve_tokens)
        self.admissions.append(record)
        return StandInAdmission(record)


class StandInKeys:
    def __init__(self, keys: dict[str, Key]) -> None:
        self.keys = keys  # secret -> key

    def authenticate(self, authorization: str | None) -> Key:
        parsed = parse_api_key(authorization)
        if parsed is None:
            raise GatewayError.invalid_key()
        key = self.keys.get(parsed[1])
        if key is None or key.key_id != parsed[0]:
            raise GatewayError.invalid_key()
        return key


class StaticRoutes:
    def __init__(self, table: RouteTable) -> None:
        self.table = table
        self.catch_ups = 0

    async def catch_up(self) -> None:
        self.catch_ups += 1


def endpoint(replica: str, url: str, *, api_key: str = SIM_KEY) -> Endpoint:
    return Endpoint(
        replica=replica,
        shard=f"shard-{replica}",
        url=url,
        api_key=api_key,
        index_model="m",
        hash=None,
        adapters={},
    )


def table(routes: dict[str, tuple[Endpoint, ...]]) -> RouteTable:
    return RouteTable({n: ModelRoute(n, n, None, eps) for n, eps in routes.items()}, 1.0)


@dataclass
class Served:
    url: str
    gateway: Gateway[Key]
    limits: StandInLimits
    registry: CollectorRegistry

    def metrics_text(self) -> str:
        return generate_latest(self.registry).decode()


@contextmanager
def serve_asgi(app: Any, *, lifespan: str = "off") -> Iterator[str]:
    """Any ASGI app under uvicorn on loopback, in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_config=None,
            access_log=False,
            lifespan=lifespan,
        )
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()

    def started() -> bool:
        assert thread.is_alive(), "the server's thread ended before it started"
        return bool(server.started)

    wait_for(started, timeout_s=20, what="the server to start", interval_s=0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@contextmanager
def serve_gateway(
    routes: RouteTable | RouteSource,
    keys: dict[str, Key],
    *,
    settings: GatewaySettings | None = None,
    intake: ShardViews | None = None,
    tokenizer_files: TokenizerSource | None = None,
    starts: Sequence[Callable[[], Awaitable[None]]] = (),
    stops: Sequence[Callable[[], Awaitable[None]]] = (),
) -> Iterator[Served]:
    """``routes``: a fixed table, or a source that keeps one current (a ``RouteCache``,
    started by ``starts`` on the gateway's own loop)."""
    registry = CollectorRegistry()
    limits = StandInLimits()
    standin_keys = StandInKeys(keys)
    gateway: Gateway[Key] = Gateway(
        settings=settings or GatewaySettings(),
        routes=StaticRoutes(routes) if isinstance(routes, RouteTable) else routes,
        authenticate=standin_keys.authenticate,
        admit=limits.admit,
        metrics=GatewayMetrics.create(registry),
        intake=intake,
        tokenizer_files=tokenizer_files,
        starts=starts,
        stops=stops,
    )
    app = RequestLog(gateway, listener="public", internal_error=internal_error)
    with serve_asgi(app, lifespan="on") as url:
        yield Served(url, gateway, limits, registry)
