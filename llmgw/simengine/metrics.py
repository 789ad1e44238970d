"""Prometheus metrics under vLLM's names, so dashboards and the router read the simulator as vLLM.

Names and labels (`model_name`, `engine`) are vLLM v1's (reference
vllm-kv-events.md §4): prefix-cache queries and hits count tokens, cache
usage is a 0..1 fraction. One registry per engine (not the global one) so
two engines in one test process never share counters.

Must NOT compute anything: the shell feeds it step results.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["EngineMetrics"]

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        *,
        block_size: int = 16,
        num_blocks: int = 4096,
        max_loras: int | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        # vLLM's info gauge: how a scraper learns the block size and capacity without flags.
        Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            [
                "engine",
                "block_size",
                "num_gpu_blocks",
                "enable_prefix_caching",
                "prefix_caching_hash_algo",
            ],
            registry=reg,
        ).labels(
            engine="0",
            block_size=str(block_size),
            num_gpu_blocks=str(num_blocks),
            enable_prefix_caching="True",
            prefix_caching_hash_algo="sha256_cbor",
        ).set(1)
        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the batch.")
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting for admission, or paused."
        )
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage (1 = every block referenced)."
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        # vLLM's KV-connector counters (always present, as in vLLM): tokens of the requests a
        # connector was asked about, and the prompt tokens it supplied (loaded, not computed).
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in tokens.",
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in tokens.",
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced.")
        self.num_preemptions = counter("vllm:num_preemptions", "Requests preempted.")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            [*names, "finished_reason"],
            registry=reg,
        )
        self._labels = labels
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            _E2E_BUCKETS,
        )

        # vLLM's LoRA info gauge, present only when LoRA is enabled (max_loras given), exposed as
        # vLLM 0.32 exposes it (vllm/v1/metrics/loggers.py, stats.py): no model_name or engine
        # label, the value is the time of the update, and each label combination ever seen stays
        # with its last time, so a reader takes the series with the highest value. Both adapter
        # labels list every adapter with an unfinished request: vLLM's LoRARequestStates fills
        # both from one dict.
        self._lora_info = (
            None
            if max_loras is None
            else Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=reg,
            )
        )
        self._max_lora = str(max_loras)

    def lora_requests(self, names: Sequence[str]) -> None:
        """Stamp the adapters with unfinished requests, as vLLM does once per engine step."""
        if self._lora_info is None:
            return
        joined = ",".join(names)
        self._lora_info.labels(
            max_lora=self._max_lora, waiting_lora_adapters=joined, running_lora_adapters=joined
        ).set_to_current_time()

    def request_finished(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
