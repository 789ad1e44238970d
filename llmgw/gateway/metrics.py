"""The gateway's Prometheus metrics, registered on the control plane's internal registry
(served by the internal listener's /metrics, never by the public one).

Labels are bounded: models and replicas are what the fleet runs, never client input (an
unknown model name is counted under ``model="_unknown"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["GatewayMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_LOCAL_TOKENIZE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05)
_TOKENIZE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25)
_SHARE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


@dataclass(frozen=True, slots=True)
class GatewayMetrics:
    decisions: Counter
    matched_share: Histogram
    tokenize_seconds: Histogram
    tokenize_failures: Counter
    tokenize_local_seconds: Histogram
    tokenizer_mode: Gauge
    tokenizer_mismatches: Counter
    tokenizer_profile_none: Gauge
    tokenizer_failing: Gauge
    index_blocks: Gauge
    approx_entries: Gauge
    requests: Counter
    request_seconds: Histogram
    ttft_seconds: Histogram
    upstream_errors: Counter
    retries: Counter
    ejections: Counter
    in_flight: Gauge
    queue_requests: Gauge
    queue_wait_seconds: Histogram
    admitted_in_flight: Gauge
    admission_limit: Gauge
    shed: Counter
    busy: Counter
    held_requests: Gauge
    adapter_held_requests: Gauge
    adapter_held_answered: Counter
    wake_seconds: Histogram
    api_requests: Counter
    api_request_seconds: Histogram
    # (metric, label values) -> child: prometheus_client's labels() takes a lock and builds a
    # key on every call, a measurable share of the gateway's per-request CPU.
    _children: dict[tuple[int, tuple[str, ...]], Any] = field(default_factory=dict)

    def _child(self, metric: Counter | Gauge | Histogram, labels: tuple[str, ...]) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def inc(self, metric: Counter, *labels: str) -> None:
        self._child(metric, labels).inc()

    def observe(self, metric: Histogram, value: float, *labels: str) -> None:
        self._child(metric, labels).observe(value)

    def add(self, metric: Gauge, delta: float, *labels: str) -> None:
        self._child(metric, labels).inc(delta)

    def gauge(self, metric: Gauge, value: float, *labels: str) -> None:
        self._child(metric, labels).set(value)

    def api_request(self, api: str, status: int, seconds: float) -> None:
        """One request of the public listener's API families, however it ended."""
        self._child(self.api_requests, (api, str(status))).inc()
        self._child(self.api_request_seconds, (api,)).observe(seconds)

    @classmethod
    def create(cls, registry: CollectorRegistry) -> GatewayMetrics:
        return cls(
            decisions=Counter(
                "llmgw_prefix_decisions",
                "Routing decisions by method (precise, approximate, least_loaded, round_robin, "
                "random) and outcome (hit, miss, overloaded, none).",
                ["model", "method", "outcome"],
                registry=registry,
            ),
            matched_share=Histogram(
                "llmgw_prefix_matched_share",
                "Share of the prompt's leading blocks the chosen replica holds (prefix tiers).",
                ["model", "method"],
                buckets=_SHARE_BUCKETS,
                registry=registry,
            ),
            tokenize_seconds=Histogram(
                "llmgw_prefix_tokenize_seconds",
                "Latency of /tokenize calls made for precise routing.",
                ["model"],
                buckets=_TOKENIZE_BUCKETS,
                registry=registry,
            ),
            tokenize_failures=Counter(
                "llmgw_prefix_tokenize_failures",
                "Tokenize calls that failed (reason: timeout, error, busy).",
                ["model", "reason"],
                registry=registry,
            ),
            tokenize_local_seconds=Histogram(
                "llmgw_prefix_tokenize_local_seconds",
                "Time to tokenize a prompt in the gateway from the model's tokenizer files "
                "(precise routing), the wait for a pool thread included.",
                ["model"],
                buckets=_LOCAL_TOKENIZE_BUCKETS,
                registry=registry,
            ),
            tokenizer_mode=Gauge(
                "llmgw_prefix_tokenizer_mode",
                "How precise routing tokenizes a model's prompts: 1 for the model's one mode "
                "(local: in the gateway from its tokenizer files; remote: a replica's "
                "/tokenize; none: not at all), 0 for the others.",
                ["model", "mode"],
                registry=registry,
            ),
            tokenizer_mismatches=Counter(
                "llmgw_prefix_tokenizer_mismatches",
                "Verifications where the gateway's local tokens differed from a replica's "
                "/tokenize (each turns local tokenizing off for those files).",
                ["model"],
                registry=registry,
            ),
            tokenizer_profile_none=Gauge(
                "llmgw_prefix_tokenizer_profile_none",
                "1 where a profile serving the model says `tokenizer: none`: its prompts are "
                "never tokenized in the gateway (mode remote, whatever files are stored), 0 "
                "otherwise.",
                ["model"],
                registry=registry,
            ),
            tokenizer_failing=Gauge(
                "llmgw_prefix_tokenizer_failing",
                "1 where local tokenizing of the model was turned off because its tokenizer "
                "or template kept failing (reason: the last error's type, deadline or "
                "crashed); its prompts go to a replica's /tokenize until new files come.",
                ["model", "reason"],
                registry=registry,
            ),
            index_blocks=Gauge(
                "llmgw_prefix_index_entries",
                "(block, shard) entries of the precise KV index per model.",
                ["model"],
                registry=registry,
            ),
            approx_entries=Gauge(
                "llmgw_prefix_approx_entries",
                "Chunk entries of the approximate prefix tree (all models).",
                registry=registry,
            ),
            requests=Counter(
                "llmgw_gateway_requests",
                "OpenAI requests answered, by model, replica (empty when none was chosen) and "
                "status code.",
                ["model", "replica", "status"],
                registry=registry,
            ),
            request_seconds=Histogram(
                "llmgw_gateway_request_seconds",
                "Time from request to the last byte of the answer.",
                ["model", "replica"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            ttft_seconds=Histogram(
                "llmgw_gateway_ttft_seconds",
                "Time from request to the first streamed token chunk.",
                ["model", "replica"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            upstream_errors=Counter(
                "llmgw_gateway_upstream_errors",
                "Upstream failures (kind: connect, status, midstream, timeout).",
                ["model", "replica", "kind"],
                registry=registry,
            ),
            retries=Counter(
                "llmgw_gateway_retries",
                "Requests retried on another replica.",
                ["model"],
                registry=registry,
            ),
            ejections=Counter(
                "llmgw_gateway_ejections",
                "Replicas ejected by passive health.",
                ["replica"],
                registry=registry,
            ),
            in_flight=Gauge(
                "llmgw_gateway_in_flight",
                "Requests being served by this gateway.",
                registry=registry,
            ),
            queue_requests=Gauge(
                "llmgw_gateway_queue_requests",
                "Requests waiting in the gateway's queue, by model and API key id.",
                ["model", "key"],
                registry=registry,
            ),
            queue_wait_seconds=Histogram(
                "llmgw_gateway_queue_wait_seconds",
                "Time requests waited in the gateway's queue (granted, shed or gone).",
                ["model", "key"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
            admitted_in_flight=Gauge(
                "llmgw_gateway_admitted_in_flight",
                "This gateway's requests in flight at each replica.",
                ["replica"],
                registry=registry,
            ),
            admission_limit=Gauge(
                "llmgw_gateway_admission_limit",
                "Each replica's admission limit now (its ceiling, halved on busy refusals and "
                "grown back by successes).",
                ["replica"],
                registry=registry,
            ),
            shed=Counter(
                "llmgw_gateway_shed",
                "Requests shed by reason: 503 for queue_requests, queue_timeout, replica_busy, "
                "wake_blocked, and for a runtime adapter adapter_loading (still loading when "
                "the wait ran out), adapter_load_failed and adapter_unplaceable; 429 for the "
                "memory bounds queue_bytes and queue_bytes_total.",
                ["model", "reason"],
                registry=registry,
            ),
            busy=Counter(
                "llmgw_gateway_replica_busy",
                "Refused or reset connections to a replica that reported itself loaded: its "
                "admission limit halved instead of a failure counted.",
                ["replica"],
                registry=registry,
            ),
            held_requests=Gauge(
                "llmgw_gateway_held_requests",
                "Requests held for an autoscaled model with no ready replica, by model (a "
                "model's row counts its adapters' too; a runtime adapter's own are "
                "llmgw_gateway_adapter_held_requests).",
                ["model"],
                registry=registry,
            ),
            adapter_held_requests=Gauge(
                "llmgw_gateway_adapter_held_requests",
                "Requests held for a runtime LoRA adapter (kind: adapter) that no ready "
                "replica has loaded, while the leader places it and an agent loads it, by "
                "adapter.",
                ["adapter"],
                registry=registry,
            ),
            adapter_held_answered=Counter(
                "llmgw_gateway_adapter_held_answered",
                "Requests held for a runtime LoRA adapter, by how their wait ended (outcome: "
                "loaded, a replica loaded it and the request went on; timeout, "
                "gateway.queue_timeout_s ran out; failed, its load failed on every replica "
                "the leader chose, answered at once; gone, the client left).",
                ["adapter", "outcome"],
                registry=registry,
            ),
            wake_seconds=Histogram(
                "llmgw_gateway_wake_seconds",
                "From a model's first held request to its first ready replica (a scale from "
                "zero or a wake from suspend, as this gateway saw it).",
                ["model"],
                buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
                registry=registry,
            ),
            api_requests=Counter(
                "llmgw_gateway_api_requests",
                "Requests to the public listener's API routes, by API family (chat, "
                "completions, responses, messages, count_tokens, embeddings, rerank, score; "
                "_unknown for a path none serves) and status code (499: the client left).",
                ["api", "status"],
                registry=registry,
            ),
            api_request_seconds=Histogram(
                "llmgw_gateway_api_request_seconds",
                "Time from request to the end of the answer, by API family.",
                ["api"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
        )
