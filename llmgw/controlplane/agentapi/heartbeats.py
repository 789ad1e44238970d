"""Batched heartbeats: unchanged syncs cost the database one UPDATE per second in total.

An unchanged sync (docs/architecture.md §5) writes nothing but its heartbeat: the node's last_sync_at and
(epoch, seq). Each is kept in memory, the newest per node, and ``flush`` writes all of them
with one statement every ``period_s``. A failed flush puts its beats back (unless a newer
one arrived meanwhile), so a database outage delays heartbeats but loses none the process
still holds. The statement itself skips rows whose stored order is already newer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.controlplane.agentapi.metrics import AgentApiMetrics
from llmgw.logs import get_logger
from llmgw.periodic import Periodic
from llmgw.store.agent_nodes import Heartbeat, flush_heartbeats

__all__ = ["HeartbeatBatcher"]

log = get_logger("llmgw.controlplane.agentapi")


class HeartbeatBatcher:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        period_s: float,
        metrics: AgentApiMetrics,
    ) -> None:
        self.sessions = sessions
        self.period_s = period_s
        self.metrics = metrics
        self._pending: dict[uuid.UUID, Heartbeat] = {}
        # The beats a flush in progress took out of _pending (put back if it fails).
        self._flushing: dict[uuid.UUID, Heartbeat] = {}
        self._flusher = Periodic(
            self.flush,
            name="agent-heartbeat-flush",
            interval_s=period_s,
            on_error=self._flush_failed,
        )
        self._lock = asyncio.Lock()

    @property
    def num_pending(self) -> int:
        """Nodes whose newest heartbeat is not written yet (a flush in progress included)."""
        return len(self._pending.keys() | self._flushing.keys())

    def record(self, node_id: uuid.UUID, *, epoch: int, seq: int, at: datetime) -> None:
        held = self._pending.get(node_id)
        if held is None or (held.epoch, held.seq) < (epoch, seq):
            self._pending[node_id] = Heartbeat(node_id, epoch, seq, at)

    async def flush(self) -> int:
        """Write what is pending in one statement; returns the rows it moved."""
        async with self._lock:  # the timer and stop() never flush at once
            if not self._pending:
                return 0
            beats, self._pending = self._pending, {}
            self._flushing = beats
            started = time.perf_counter()
            try:
                async with self.sessions() as session, session.begin():
                    moved = await flush_heartbeats(session, list(beats.values()))
            except BaseException:
                for beat in beats.values():
                    self.record(beat.node_id, epoch=beat.epoch, seq=beat.seq, at=beat.at)
                raise
            finally:
                self._flushing = {}
            self.metrics.heartbeat_flush_seconds.observe(time.perf_counter() - started)
            self.metrics.heartbeat_flush_rows.observe(len(beats))
            return moved

    async def start(self) -> None:
        self._flusher.start()

    def _flush_failed(self, exc: Exception, _failures: int = 0) -> None:
        # Transient (database down): the beats are kept, retried next period.
        log.warning("heartbeat_flush_failed", pending=len(self._pending), error=repr(exc))

    async def stop(self) -> None:
        """Stop the timer and flush once more, so a clean shutdown loses no heartbeat."""
        await self._flusher.stop()
        try:
            await self.flush()
        except Exception as exc:
            self._flush_failed(exc)
