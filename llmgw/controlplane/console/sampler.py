"""The console's sampler: every ``INTERVAL_S`` it reads this process's metrics registry (the
gateway's counters, histograms and gauges, in process: no HTTP, no text parsing) and appends
one row to the ring the Routing page and the overview's hit-rate chart draw.

Each control plane keeps its own ring, of its own gateway's decisions: behind a balancer, each
instance shows what it routed. The ring is memory only, bounded (``CAPACITY`` rows of at most
``MAX_SERIES`` series: 1 h at 10 s, about 7 MB at the very worst, ~100 KB for the demo),
and a restart begins an empty one: the charts show a gap, never an error.

What it must NOT do: block the loop (the gateway serves on it). Reading the metrics walks
every histogram bucket of every replica (16 models x 4 replicas: ~2300 samples, 12-17 ms on a
busy 2-core host, about what one Prometheus scrape of /metrics costs), so reads run in a
worker thread (prometheus_client's metrics take their own locks), only the families the
charts use are collected, and the pages' tables share one read per ``_FRESH_S``. Nor may it
fail the control plane: a sample that raises is logged and skipped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.registry import RestrictedRegistry

from llmgw.controlplane.console.ring import Ring
from llmgw.controlplane.console.routing_view import Sample, Snapshot, read_snapshot, step
from llmgw.periodic import Periodic

__all__ = ["CAPACITY", "INTERVAL_S", "MAX_SERIES", "RoutingSampler"]

log = structlog.get_logger("llmgw.console")

# The samples the routing view reads (routing_view.read_snapshot): the registry collects only
# their families, not the whole process's (the reconciler's, the agent API's, the queues').
SAMPLES = frozenset(
    {
        "llmgw_prefix_decisions_total",
        "llmgw_prefix_matched_share_sum",
        "llmgw_prefix_matched_share_count",
        "llmgw_gateway_ttft_seconds_bucket",
        "llmgw_prefix_tokenizer_mode",
        "llmgw_gateway_admitted_in_flight",
        "llmgw_gateway_admission_limit",
        "llmgw_gateway_requests_total",
    }
)
INTERVAL_S = 10.0
# Tables refreshed every 3 s in any number of tabs share a read this young.
_FRESH_S = 2.0
CAPACITY = 360  # 1 h at 10 s
# 16 models x (20 method/outcome pairs + hit rate + matched share + 2 TTFT quantiles) and
# 64 replicas x 2 gauges is 512; the rest is headroom, and a series past it is refused.
MAX_SERIES = 600


class RoutingSampler:
    def __init__(
        self,
        registry: CollectorRegistry | None,
        *,
        interval_s: float = INTERVAL_S,
        capacity: int = CAPACITY,
    ) -> None:
        self._registry: RestrictedRegistry | None = (
            registry.restricted_registry(SAMPLES) if registry is not None else None
        )
        self.interval_s = interval_s
        self.ring = Ring(capacity=capacity, interval_s=interval_s, max_series=MAX_SERIES)
        self._last: Snapshot | None = None
        self._last_at = 0.0
        self._read: tuple[float, Snapshot] | None = None

    def read(self) -> Snapshot:
        """The gateway's state now (the Routing page's tables read this, not the ring)."""
        return read_snapshot(self._samples())

    async def read_off_loop(self) -> Snapshot:
        now = time.monotonic()
        if self._read is not None and now - self._read[0] < _FRESH_S:
            return self._read[1]
        snapshot = await asyncio.to_thread(self.read)
        self._read = (now, snapshot)
        return snapshot

    def sample(self, now: float, cur: Snapshot | None = None) -> None:
        """Append the row from ``cur`` (read now when not given) to the ring."""
        cur = cur if cur is not None else self.read()
        prev = self._last
        self.ring.add(now, step(prev, cur, now - self._last_at if prev is not None else 0.0))
        self._last, self._last_at = cur, now

    async def run(self, stop: asyncio.Event) -> None:
        """Sample now and every ``interval_s`` until ``stop`` is set."""
        sampler = Periodic(
            self._sample_now,
            name="console-sampler",
            interval_s=self.interval_s,
            run_at_start=True,
            on_error=_sample_failed,
        )
        sampler.start()
        try:
            await stop.wait()
        finally:
            await sampler.stop()

    async def _sample_now(self) -> None:
        # Never the tables' cached read: a rate needs the time it was read at.
        cur = await asyncio.to_thread(self.read)
        # The ring is touched on the loop only: the pages read it there.
        self.sample(time.time(), cur)

    def _samples(self) -> Iterator[Sample]:
        if self._registry is None:
            return
        for family in self._registry.collect():
            for s in family.samples:
                yield s.name, s.labels, s.value


def _sample_failed(exc: Exception, _failures: int) -> None:
    log.warning("console_sample_failed", error=repr(exc))  # a chart is not worth a control plane
