"""What the KV path reads instead of the database: where each shard is placed.

Design §5: no database traffic on the KV path. The map is read in one statement every
``refresh_s``; a sync that reads a node's desired set replaces that node's entries at once,
so a new shard's KV deltas are accepted as soon as its agent synced with this instance (the
other instances learn it by their next refresh; until then they answer ``retry``). Shards no
longer placed are dropped from the intake's index on each refresh. Node credentials for the
KV path come from ``NodeTable``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.kv.shard_views import PlacedShard, ShardViews
from llmgw.logs import get_logger
from llmgw.periodic import Periodic
from llmgw.store.agent_shards import PlacedRow, read_placed

__all__ = ["PlacedCache"]

log = get_logger("llmgw.controlplane.agentapi")


class PlacedCache:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        intake: ShardViews,
        *,
        refresh_s: float,
    ) -> None:
        self.sessions = sessions
        self.intake = intake
        self.refresh_s = refresh_s
        self.placed: dict[str, PlacedShard] = {}
        self._refresher = Periodic(
            self._refresh_quietly, name="agent-placed-refresh", interval_s=refresh_s
        )

    async def refresh(self) -> None:
        async with self.sessions() as session, session.begin():
            rows = await read_placed(session)
        self.placed = {str(r.shard_id): _placed(r) for r in rows}
        dropped = self.intake.forget_unplaced(self.placed)
        if dropped:
            log.info("kv_shards_forgotten", count=len(dropped))

    def set_node(self, node_id: uuid.UUID, rows: Iterable[PlacedRow]) -> None:
        """Replace one node's entries with what a sync just read."""
        node = str(node_id)
        placed = {k: v for k, v in self.placed.items() if v.node_id != node}
        placed.update((str(r.shard_id), _placed(r)) for r in rows)
        self.placed = placed

    def placed_map(self) -> Mapping[str, PlacedShard]:
        return self.placed

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:  # the database may be down: keep serving what we hold
            log.warning("placed_refresh_failed", error=repr(exc))

    async def start(self) -> None:
        await self._refresh_quietly()
        self._refresher.start()

    async def stop(self) -> None:
        await self._refresher.stop()


def _placed(r: PlacedRow) -> PlacedShard:
    return PlacedShard(
        node_id=str(r.node_id), model=r.model, block_size=r.block_size, max_blocks=r.max_blocks
    )
