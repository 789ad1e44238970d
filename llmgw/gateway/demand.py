"""Reporting this gateway's per-model demand to Postgres every few seconds, off the request
path: one batched statement (``store.demand.write_demand``) of what ``FlowControl`` holds.

What it must NOT do: block or fail a request (a failed write is logged and the next period
writes the current counts anyway).
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.gateway.flow import FlowControl
from llmgw.logs import get_logger
from llmgw.periodic import Periodic
from llmgw.store.demand import DemandRow, write_demand

__all__ = ["DEMAND_PERIOD_S", "DemandReporter"]

log = get_logger("llmgw.gateway")

DEMAND_PERIOD_S = 2.0


class DemandReporter:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        instance_id: str,
        flow: Callable[[], FlowControl],
        clock: Callable[[], float],
        period_s: float = DEMAND_PERIOD_S,
    ) -> None:
        self._sessions = sessions
        self._instance_id = instance_id
        self._flow = flow
        self._clock = clock
        self.period_s = period_s
        # No backoff: the next period writes the current counts anyway, and a failed write
        # is logged once until one succeeds.
        self._reporter = Periodic(
            self.report,
            name="gateway-demand",
            interval_s=period_s,
            on_error=self._write_failed,
        )

    def wake(self) -> None:
        """Report now, not at the next period: a request is held with no ready replica."""
        self._reporter.wake()

    async def report(self) -> None:
        now = self._clock()
        rows = [
            DemandRow(
                d.model,
                d.queued,
                d.in_flight,
                d.shed,
                None if d.saturated_since is None else max(0.0, now - d.saturated_since),
                queued_prefill_tokens=d.queued_prefill_tokens,
                uncached_prefill_tokens=d.uncached_prefill_tokens,
                held=d.held,
                engine_waiting=d.engine_waiting,
                hit_rate=d.hit_rate,
                requests_per_s=d.requests_per_s,
            )
            for d in self._flow().snapshot()
        ]
        # While anything is held (a model at zero replicas, an adapter loaded nowhere) the
        # leader is woken on every report: a leader that took over meanwhile learns of it
        # within a period, not only at its own tick.
        notify = any(r.held for r in rows)
        async with self._sessions() as session, session.begin():
            await write_demand(session, self._instance_id, rows, notify=notify)

    async def start(self) -> None:
        self._flow().on_hold = self.wake
        self._reporter.start()

    def _write_failed(self, exc: Exception, failures: int) -> None:
        if failures == 1:  # Postgres may be down: the gateway serves on
            log.warning("gateway_demand_write_failed", error=type(exc).__name__)

    async def stop(self) -> None:
        await self._reporter.stop()
