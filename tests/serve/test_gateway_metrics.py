"""Merging the gateway workers' expositions into the control plane's (serve/gateway_metrics.py):
per-worker counts are summed, a fact every worker states alike is not, and the agent API's
own families are left to the control plane's registry."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from llmgw.serve.gateway_metrics import merge

WORKER = """\
# TYPE llmgw_prefix_decisions_total counter
llmgw_prefix_decisions_total{method="precise",model="demo",outcome="hit"} %d
# TYPE llmgw_prefix_tokenizer_mode gauge
llmgw_prefix_tokenizer_mode{model="demo",mode="local"} 1
# TYPE llmgw_agent_kv_requests_total counter
llmgw_agent_kv_requests_total{result="ack"} 5
"""

CAP = 64 << 10


def test_workers_are_summed_facts_are_not_and_agent_families_stay_out() -> None:
    families = merge([WORKER % 2, WORKER % 3])

    class Fixed(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            return families

    registry = CollectorRegistry()
    registry.register(Fixed())
    text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    hit = (("method", "precise"), ("model", "demo"), ("outcome", "hit"))
    assert samples[("llmgw_prefix_decisions_total", hit)] == 5
    assert samples[("llmgw_prefix_tokenizer_mode", (("mode", "local"), ("model", "demo")))] == 1
    assert "llmgw_agent_kv_requests" not in text
    assert merge([]) == []


async def test_read_takes_gateways_only_and_skips_one_past_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import httpx

    from llmgw.protocol.sync import ControlPlaneInstance
    from llmgw.serve import gateway_metrics

    monkeypatch.setattr(gateway_metrics, "_MAX_BYTES", CAP)
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host == "big":  # past the cap, with no Content-Length

            async def chunks() -> AsyncIterator[bytes]:  # samples, then comment lines
                yield (WORKER % 100).encode()
                for _ in range(CAP >> 10):
                    yield b"#" * 1023 + b"\n"

            return httpx.Response(200, content=chunks())
        return httpx.Response(200, text=WORKER % 2)

    instances = [
        ControlPlaneInstance(id="gateway-a", internal_url="http://a"),
        ControlPlaneInstance(id="gateway-b", internal_url="http://big"),
        ControlPlaneInstance(id="cp-1", internal_url="http://cp"),
    ]
    reader = gateway_metrics.GatewayMetrics(lambda: instances)
    reader._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    try:
        await reader.read()
    finally:
        await reader.stop()
    assert sorted(asked) == ["a", "big"]
    names = {s.name: s.value for f in reader.collect() for s in f.samples}
    assert names["llmgw_prefix_decisions_total"] == 2


def test_a_restricted_read_by_the_consoles_names_finds_the_merged_families() -> None:
    # The console's sampler reads its registry restricted to the families its charts use; a
    # collector that describes nothing is never asked, and the Routing page stayed empty
    # while the gateway ran in its own process.
    from llmgw.controlplane.console.sampler import SAMPLES
    from llmgw.serve.gateway_metrics import GatewayMetrics

    registry = CollectorRegistry()
    reader = GatewayMetrics(lambda: [])
    reader._families = merge([WORKER % 7])
    registry.register(reader)
    samples = {
        s.name: s.value for f in registry.restricted_registry(SAMPLES).collect() for s in f.samples
    }
    assert samples["llmgw_prefix_decisions_total"] == 7
