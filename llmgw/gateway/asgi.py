"""The public listener's app: the OpenAI gateway (``llmgw.gateway.app``), wired.

This module only assembles: the key cache (``gateway.keys``), the per-key limiter and the usage
recorder it settles to (``gateway.limits``, ``gateway.accounting``), the route cache, the
gateway's metrics on the process's internal registry, and the KV index the internal
listener's agent API feeds, shared so that the router scores against the blocks agents report
to this very process.

What it must not do: mount anything of the admin API, the agent API, metrics or the docs.
Those live on the internal listener only (docs/architecture.md §1): the admin token can set engine argv on
every node, so its API must not answer on an address published to clients.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.types import ASGIApp

from llmgw.config import GatewaySettings
from llmgw.gateway.accounting import UsageRecorder
from llmgw.gateway.app import Gateway
from llmgw.gateway.demand import DemandReporter
from llmgw.gateway.errors import internal_error
from llmgw.gateway.keys import KeyCache, KeyContext
from llmgw.gateway.limits import Limiter
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routes import RouteCache
from llmgw.gateway.routing.inputs import KvView
from llmgw.gateway.tokenizer_files import TokenizerFilesCache
from llmgw.http.request_log import RequestLog

__all__ = ["create_public_app"]


def create_public_app(
    settings: GatewaySettings,
    *,
    sessions: async_sessionmaker[AsyncSession],
    libpq_url: str,
    registry: CollectorRegistry,
    intake: KvView,
    instance_id: str = "",
) -> ASGIApp:
    """``intake``: the KV index the agent API feeds (the process's ``ShardViews``);
    ``instance_id``: this control plane's, under which the gateway reports its demand
    (empty: no report)."""
    keys = KeyCache(sessions=sessions, libpq_url=libpq_url)
    recorder = UsageRecorder(sessions=sessions)
    limiter = Limiter(recorder=recorder)
    routes = RouteCache(sessions, libpq_url=libpq_url, refresh_s=settings.routes_refresh_s)
    tokenizers = TokenizerFilesCache(sessions, libpq_url=libpq_url)
    holder: list[Gateway[KeyContext]] = []
    demand = DemandReporter(
        sessions, instance_id=instance_id, flow=lambda: holder[0].flow, clock=time.monotonic
    )
    reports = (demand.start,) if instance_id else ()
    gateway: Gateway[KeyContext] = Gateway(
        settings=settings,
        routes=routes,
        authenticate=keys.authenticate,
        admit=limiter.admit,
        metrics=GatewayMetrics.create(registry),
        intake=intake,
        tokenizer_files=tokenizers,
        # Stopped in reverse: routes, then the recorder's final flush, then the keys.
        starts=(keys.start, recorder.start, routes.start, tokenizers.start, *reports),
        stops=(keys.stop, recorder.stop, routes.stop, tokenizers.stop, demand.stop),
    )
    holder.append(gateway)
    return RequestLog(gateway, listener="public", internal_error=internal_error)
