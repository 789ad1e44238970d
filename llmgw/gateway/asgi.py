"""The public listener's app: the OpenAI gateway (``llmgw.gateway.app``), wired.

This module only assembles: the key cache (``gateway.keys``), the per-key limiter and the usage
recorder it settles to (``gateway.limits``, ``gateway.accounting``), the route cache, the
gateway's metrics on the process's internal registry, and the KV index the internal
listener's agent API feeds, shared so that the router scores against the blocks agents report
to this very process. The caches hear of changes through the process's one LISTEN connection
(``store.notify.NotifyHub``), which ``llmgw.serve`` builds and runs.

What it must not do: mount anything of the admin API, the agent API, metrics or the docs.
Those live on the internal listener only (docs/architecture.md §1): the admin token can set engine argv on
every node, so its API must not answer on an address published to clients.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.types import ASGIApp

from llmgw.config import GatewaySettings
from llmgw.gateway.accounting import UsageRecorder
from llmgw.gateway.apis.response_ids import ResponseIds
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
from llmgw.store.catalog import cluster_response_id_secret
from llmgw.store.notify import NotifyHub

__all__ = ["create_public_app"]


def create_public_app(
    settings: GatewaySettings,
    *,
    sessions: async_sessionmaker[AsyncSession],
    notify: NotifyHub | None,
    registry: CollectorRegistry,
    intake: KvView,
    instance_id: str = "",
) -> ASGIApp:
    """``notify``: the process's hub, through which the key, route and tokenizer-file caches
    hear of changes (None: only their periods); ``intake``: the KV index the agent API feeds
    (the process's ``ShardViews``); ``instance_id``: this control plane's, under which the
    gateway reports its demand (empty: no report)."""
    keys = KeyCache(sessions=sessions, notify=notify)
    recorder = UsageRecorder(sessions=sessions)
    limiter = Limiter(recorder=recorder)
    routes = RouteCache(sessions, notify=notify, refresh_s=settings.routes_refresh_s)
    tokenizers = TokenizerFilesCache(sessions, notify=notify)
    starts = [keys.start, recorder.start, routes.start, tokenizers.start]
    stops = [keys.stop, recorder.stop, routes.stop, tokenizers.stop]
    if instance_id:
        # The reporter reads the gateway's flow control only once started, by when the gateway
        # below exists: built first, it joins the lists, starting last and stopping first.
        demand = DemandReporter(sessions, instance_id=instance_id,
                                flow=lambda: gateway.flow, clock=time.monotonic)  # fmt: skip
        starts.append(demand.start)
        stops.append(demand.stop)
    # Response ids are signed with the cluster's secret, read before the listener serves, so
    # a follow-up wrapped by any gateway of the cluster unwraps here.
    response_ids = ResponseIds([os.urandom(32)])

    async def load_response_id_secret() -> None:
        async with sessions() as session:
            response_ids.use([await cluster_response_id_secret(session)])

    starts.insert(0, load_response_id_secret)
    gateway: Gateway[KeyContext] = Gateway(
        settings=settings,
        routes=routes,
        authenticate=keys.authenticate,
        admit=limiter.admit,
        metrics=GatewayMetrics.create(registry),
        intake=intake,
        tokenizer_files=tokenizers,
        # Stopped in reverse: the demand report, routes, the recorder's final flush, the keys.
        starts=starts,
        stops=stops,
        response_ids=response_ids,
    )
    return RequestLog(gateway, listener="public", internal_error=internal_error)
