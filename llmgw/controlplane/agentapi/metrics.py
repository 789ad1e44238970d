"""Prometheus metrics of the agent API, registered on the registry the caller passes.

Label values are closed sets (results, reasons, endpoints), never node or shard ids: a
label per node would make 1,000 series per metric.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["AgentApiMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_ROW_BUCKETS = (0, 1, 10, 50, 100, 250, 500, 1000, 2500, 5000)


@dataclass(frozen=True, slots=True)
class AgentApiMetrics:
    syncs: Counter
    sync_seconds: Histogram
    registrations: Counter
    auth_failures: Counter
    foreign_bindings: Counter
    shards_released: Counter
    heartbeat_flush_rows: Histogram
    heartbeat_flush_seconds: Histogram
    kv_requests: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AgentApiMetrics:
        return cls(
            syncs=Counter(
                "llmgw_agent_syncs",
                "Agent syncs answered, by result: unchanged (a heartbeat only), changed "
                "(state written or a desired set sent), stale (older than held), pending.",
                ["result"],
                registry=registry,
            ),
            sync_seconds=Histogram(
                "llmgw_agent_sync_seconds",
                "Time to answer a sync, body read to response, by result.",
                ["result"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            registrations=Counter(
                "llmgw_agent_registrations",
                "Node registrations, by result (ok, or why refused).",
                ["result"],
                registry=registry,
            ),
            auth_failures=Counter(
                "llmgw_agent_auth_failures",
                "Agent API requests refused for their credential, by endpoint and reason.",
                ["endpoint", "reason"],
                registry=registry,
            ),
            foreign_bindings=Counter(
                "llmgw_agent_foreign_bindings",
                "Bindings ignored because they named a shard that is not the node's own.",
                registry=registry,
            ),
            shards_released=Counter(
                "llmgw_agent_shards_released",
                "Shards desired stopped released because their agent reported them gone.",
                registry=registry,
            ),
            heartbeat_flush_rows=Histogram(
                "llmgw_agent_heartbeat_flush_rows",
                "Nodes per batched heartbeat UPDATE.",
                buckets=_ROW_BUCKETS,
                registry=registry,
            ),
            heartbeat_flush_seconds=Histogram(
                "llmgw_agent_heartbeat_flush_seconds",
                "Time of one batched heartbeat UPDATE, commit included.",
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            kv_requests=Counter(
                "llmgw_agent_kv_requests",
                "KV delta requests, by result (ack, retry, need_full, or why refused).",
                ["result"],
                registry=registry,
            ),
        )
