"""Every registered node's sync-relevant row, in memory: how unchanged syncs cost no query.

At 1,000 nodes syncing every 2 s, reading the node's row on every sync is 500 queries a
second for answers that almost never change. Instead the whole table (credential hash,
approval, drain, desired_version, stored report order) is read in ONE statement every
``refresh_s``, and an unchanged sync is decided from memory. What that costs, bounded by
``refresh_s``:

- a desired set the reconciler changed reaches its agent up to ``refresh_s`` later (on top
  of the agent's sync interval); the changed path itself always reads the node fresh, in its
  transaction, and stores what it read here, so one change is never answered twice;
- a deleted node or replaced credential is still accepted on UNCHANGED syncs and on the KV
  path for up to ``refresh_s``. Those write nothing but a heartbeat (which for a deleted
  node matches no row); any sync that writes re-checks the credential against the row.

``refresh_s = 0`` reads the row on every sync instead (no staleness, a query per sync); the
table is then still re-read every ``background_s`` for the KV path's credentials.

A node id no row has is remembered as unknown for ``UNKNOWN_TTL_S`` (at most ``UNKNOWN_MAX``
ids): a sync is authenticated against its node's row, and without this every repeat of a
forged or deleted id (an agent retrying, a flood of one id) cost a transaction. A node that
registers through this process is forgotten as unknown at once (``registered``); one that
registers through another instance is refused here for at most the TTL, which its agent's
next sync outlasts (it syncs every few seconds and retries a refusal).

Reads of ids the table does not hold are rationed by one token bucket for the whole process
(``unknown_lookups``): remembering an id helps against its repeats, not against a flood of
distinct random ids, each of which would cost a transaction (a credential cannot be checked
without its row). Past the bucket ``lookup`` raises ``LookupThrottled`` before any query,
and the agent API answers 429 with Retry-After, which an agent retries like any 429. Nodes
the table holds (every registered node after its first refresh) never wait on it.

``desired_version`` and the report order only grow, so merging keeps the larger of what a
refresh read and what this process wrote meanwhile: a refresh that started before a sync's
commit never moves a node back.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Final

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.eventloop import cancel_and_wait
from llmgw.logs import get_logger
from llmgw.periodic import Periodic
from llmgw.ratelimit import TokenBucket
from llmgw.store.agent_nodes import SyncNode, read_sync_node, read_sync_nodes

__all__ = ["UNKNOWN_MAX", "UNKNOWN_TTL_S", "LookupThrottled", "NodeTable"]

log = get_logger("llmgw.controlplane.agentapi")

# A miss on the KV path (a node that registered on another instance a moment ago) triggers a
# refresh, but at most this often: random node ids in forged headers must not each cost a
# query.
_MISS_REFRESH_MIN_S = 1.0
# Short: it is also how long a node registered through another instance may be refused here.
UNKNOWN_TTL_S: Final = 2.0
# ~100 bytes an entry: a flood of distinct ids holds ~1 MB at most, the oldest dropped first.
UNKNOWN_MAX: Final = 10_000


class LookupThrottled(Exception):
    """Too many reads of node ids not held, process-wide: retry after ``retry_after_s``."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"unknown-node lookups are rationed; retry in {retry_after_s:.2f} s")
        self.retry_after_s = retry_after_s


def _merged(new: SyncNode, held: SyncNode | None) -> SyncNode:
    if held is None or held.credential_hash != new.credential_hash:
        return new
    order = max((new.agent_epoch, new.agent_seq), (held.agent_epoch, held.agent_seq))
    return replace(
        new,
        desired_version=max(new.desired_version, held.desired_version),
        agent_epoch=order[0],
        agent_seq=order[1],
    )


class NodeTable:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        refresh_s: float,
        unknown_lookups: TokenBucket,
        background_s: float = 5.0,
    ) -> None:
        self.sessions = sessions
        self.unknown_lookups = unknown_lookups
        self.refresh_s = refresh_s
        self.period_s = refresh_s if refresh_s > 0 else background_s
        self.nodes: dict[uuid.UUID, SyncNode] = {}
        # node id -> when (monotonic) it stops being known as unknown; oldest first, since
        # every entry lives the same TTL.
        self._unknown: OrderedDict[uuid.UUID, float] = OrderedDict()
        self._refreshed_at = 0.0
        self._refresher = Periodic(
            self._refresh_quietly, name="agent-node-table-refresh", interval_s=self.period_s
        )
        self._miss_task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        self._refreshed_at = time.monotonic()
        async with self.sessions() as session, session.begin():
            rows = await read_sync_nodes(session)
        held = self.nodes
        self.nodes = {n.id: _merged(n, held.get(n.id)) for n in rows}

    def put(self, node: SyncNode) -> None:
        """Record a row this process just read (or wrote) fresh."""
        self.nodes[node.id] = _merged(node, self.nodes.get(node.id))

    def forget(self, node_id: uuid.UUID) -> None:
        self.nodes.pop(node_id, None)

    async def read_fresh(self, node_id: uuid.UUID) -> SyncNode | None:
        async with self.sessions() as session, session.begin():
            node = await read_sync_node(session, node_id)
        if node is None:
            self.forget(node_id)
        else:
            self.put(node)
        return node

    async def lookup(self, node_id: uuid.UUID) -> SyncNode | None:
        """For sync: the cached row, or a fresh read for a node not cached (or always, with
        ``refresh_s = 0``); None without a query for an id read as unknown moments ago;
        ``LookupThrottled``, without a query, for an id not held past the bucket."""
        if self.refresh_s > 0:
            cached = self.nodes.get(node_id)
            if cached is not None:
                return cached
        now = time.monotonic()
        until = self._unknown.get(node_id)
        if until is not None and now < until:
            return None
        if node_id not in self.nodes:
            wait_s = self.unknown_lookups.admit(now)
            if wait_s is not None:
                raise LookupThrottled(wait_s)
        node = await self.read_fresh(node_id)
        if node is None:
            self._remember_unknown(node_id, now)
        return node

    def _remember_unknown(self, node_id: uuid.UUID, now: float) -> None:
        unknown = self._unknown
        unknown.pop(node_id, None)
        # The expired ones first (they are the oldest), then the oldest live one if still full.
        while unknown and (next(iter(unknown.values())) <= now or len(unknown) >= UNKNOWN_MAX):
            unknown.popitem(last=False)
        unknown[node_id] = now + UNKNOWN_TTL_S

    def registered(self, node_id: uuid.UUID) -> None:
        """A node registered through this process: its first sync must read its row, whatever
        was cached of it (unknown, or a row an admin created without a credential)."""
        self._unknown.pop(node_id, None)
        self.forget(node_id)

    def cached(self, node_id: uuid.UUID) -> SyncNode | None:
        """For the KV path, which never queries: a miss schedules a (rate-limited) refresh."""
        found = self.nodes.get(node_id)
        if (
            found is None
            and time.monotonic() - self._refreshed_at >= _MISS_REFRESH_MIN_S
            and (self._miss_task is None or self._miss_task.done())
        ):
            self._miss_task = asyncio.create_task(self._refresh_quietly())
        return found

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:  # the database may be down: keep answering from memory
            log.warning("node_table_refresh_failed", error=repr(exc))

    async def start(self) -> None:
        await self._refresh_quietly()
        self._refresher.start()

    async def stop(self) -> None:
        await self._refresher.stop()
        await cancel_and_wait(self._miss_task)
        self._miss_task = None
