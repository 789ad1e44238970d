"""The console's sampler: every ``INTERVAL_S`` it reads this process's metrics registry (the
gateway's counters, histograms and gauges, in process: no HTTP, no text parsing) and appends
one row to the ring the Routing page and the overview's hit-rate chart draw.

Each control plane keeps its own ring, of its own gateway's decisions: behind a balancer, each
instance shows what it routed. The ring is memory only, bounded (``CAPACITY`` rows of at most
``MAX_SERIES`` series: 1 h at 10 s, about 7 MB at the very worst, a few KB for a small fleet),
and a restart begins an empty one: the charts show a gap, never an error.

What it must NOT do: block the loop for long (one ``collect()`` of the registry is a few
hundred microseconds for a fleet of dozens of replicas) or fail the control plane: a sample
that raises is logged and skipped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import structlog
from prometheus_client import CollectorRegistry

from llmgw.controlplane.console.ring import Ring
from llmgw.controlplane.console.routing_view import Sample, Snapshot, read_snapshot, step
from llmgw.eventloop import wait_event

__all__ = ["CAPACITY", "INTERVAL_S", "MAX_SERIES", "RoutingSampler"]

log = structlog.get_logger("llmgw.console")

INTERVAL_S = 10.0
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
        self._registry = registry
        self.interval_s = interval_s
        self.ring = Ring(capacity=capacity, interval_s=interval_s, max_series=MAX_SERIES)
        self._last: Snapshot | None = None
        self._last_at = 0.0

    def read(self) -> Snapshot:
        """The gateway's state now (the Routing page's tables read this, not the ring)."""
        return read_snapshot(self._samples())

    def sample(self, now: float) -> None:
        cur = self.read()
        prev = self._last
        self.ring.add(now, step(prev, cur, now - self._last_at if prev is not None else 0.0))
        self._last, self._last_at = cur, now

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.sample(time.time())
            except Exception as exc:  # a chart is not worth a control plane
                log.warning("console_sample_failed", error=repr(exc))
            await wait_event(stop, self.interval_s)

    def _samples(self) -> Iterator[Sample]:
        if self._registry is None:
            return
        for family in self._registry.collect():
            for s in family.samples:
                yield s.name, s.labels, s.value
