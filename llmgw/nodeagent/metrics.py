"""The agent's Prometheus metrics and its local /healthz and /metrics endpoints.

The endpoints listen on a local port (agent.listen_host, loopback by
default): they say nothing an operator on the node should not see, and
nothing on them takes an action. The listener runs under ``limits`` (llmgw/http/listeners.py:
the head's size and deadline, the connection cap); aiohttp's low-level server, as the proxy's,
since the bounds are applied where a connection is handled, and two routes need no router.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.http.listeners import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    ListenerLimits,
    aiohttp_server,
)
from llmgw.nodeagent.adapter_sync import AdapterCounts

__all__ = ["AgentMetrics", "EndpointServer"]

_STATES = ("starting", "ready", "unhealthy", "draining", "exited", "failed")

# What the agent's settings default to (agent.listen_max_connections, agent.max_header_bytes,
# agent.header_timeout_s).
DEFAULT_LIMITS = ListenerLimits(
    listener="agent-metrics",
    max_connections=256,
    max_header_bytes=DEFAULT_MAX_HEADER_BYTES,
    header_timeout_s=DEFAULT_HEADER_TIMEOUT_S,
    connections_setting="agent.listen_max_connections",
    header_bytes_setting="agent.max_header_bytes",
)


class _StateCollector(Collector):
    def __init__(
        self,
        shard_counts: Callable[[], dict[str, int]],
        counters: Callable[[], dict[str, int]],
        sync_failures: Callable[[], int],
    ) -> None:
        self._shard_counts = shard_counts
        self._counters = counters
        self._sync_failures = sync_failures

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily(
            "llmgw_agent_shards", "Shards on this node by observed state.", labels=["state"]
        )
        counts = self._shard_counts()
        for s in _STATES:
            g.add_metric([s], counts.get(s, 0))
        yield g
        c = CounterMetricFamily(
            "llmgw_agent_shard_actions",
            "Supervisor actions since the agent started (start, restart, stop, adopt).",
            labels=["action"],
        )
        for k, v in sorted(self._counters().items()):
            c.add_metric([k], v)
        yield c
        f = CounterMetricFamily(
            "llmgw_agent_sync_failures", "Failed syncs with the control plane since start."
        )
        f.add_metric([], self._sync_failures())
        yield f


class _AdapterCollector(Collector):
    """Runtime LoRA adapters per shard (adapter_sync.py): series of a shard gone from the node
    go with it."""

    def __init__(self, counts: Callable[[], list[AdapterCounts]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Any]:
        counts = self._counts()
        loads = CounterMetricFamily(
            "llmgw_agent_adapter_loads",
            "Runtime LoRA adapter loads per shard, by outcome (ok, failed): failed counts every "
            "refused path, failed download and engine refusal, each retried with backoff.",
            labels=["shard", "outcome"],
        )
        unloads = CounterMetricFamily(
            "llmgw_agent_adapter_unloads",
            "Runtime LoRA adapters unloaded per shard (no longer placed, or placed from a new path).",
            labels=["shard"],
        )
        loaded = GaugeMetricFamily(
            "llmgw_agent_adapters_loaded",
            "Runtime LoRA adapters the shard's engine holds, as the agent knows it.",
            labels=["shard"],
        )
        for c in counts:
            loads.add_metric([c.shard, "ok"], c.loads_ok)
            loads.add_metric([c.shard, "failed"], c.loads_failed)
            unloads.add_metric([c.shard], c.unloads)
            loaded.add_metric([c.shard], c.loaded)
        yield loads
        yield unloads
        yield loaded


class AgentMetrics:
    def __init__(
        self,
        *,
        shard_counts: Callable[[], dict[str, int]],
        counters: Callable[[], dict[str, int]],
        sync_failures: Callable[[], int],
        adapter_counts: Callable[[], list[AdapterCounts]] = list,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.sync_latency = Histogram(
            "llmgw_agent_sync_latency_seconds",
            "Round trip of one sync with the control plane.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.registry.register(_StateCollector(shard_counts, counters, sync_failures))
        self.registry.register(_AdapterCollector(adapter_counts))


class EndpointServer:
    """/healthz (JSON) and /metrics (Prometheus text) on a local port."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Callable[[], dict[str, Any]],
        *,
        limits: ListenerLimits = DEFAULT_LIMITS,
    ) -> None:
        self._host = host
        self._port = port
        self._registry = registry
        self._health = health
        self.limits = limits
        self._runner: web.ServerRunner | None = None
        self.port = 0
        self.started_at = time.time()

    async def _handle(self, request: web.BaseRequest) -> web.Response:
        # No body is read: nothing here takes one.
        if request.path not in ("/healthz", "/metrics"):
            return web.Response(status=404, text="not found: GET /healthz or /metrics\n")
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text=f"method {request.method} not allowed: use GET\n")
        if request.path == "/healthz":
            return web.Response(text=json.dumps(self._health()), content_type="application/json")
        return web.Response(
            body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def start(self) -> int:
        server = aiohttp_server(self._handle, self.limits, access_log=None)
        self._runner = web.ServerRunner(server, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else self._port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
