"""The agent's half of a node, and what a sync reads of the node: registration (the node row
claimed or created, its first status), each sync's order and stamp, batched heartbeats, and
the node's ``desired_version``.

Functions take a session, flush, and never commit: the caller owns the transaction
(``async with session.begin():``), so a refused registration or a sync that fails half-way
leaves nothing behind, and in-memory caches are updated only after the commit.

``node_status`` is written only here; of ``nodes`` the agent API writes the credential at
registration and bumps ``desired_version`` when an agent's report released shards
(``store/agent_shards.py``), the rest belongs to admins and the reconciler.

This module must not import FastAPI or the node agent, or log secrets.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.protocol.sync import NodeInventory
from llmgw.store.bulk import jsonb_rows

__all__ = [
    "Heartbeat",
    "SyncNode",
    "bump_desired_version",
    "claim_or_insert_node",
    "flush_heartbeats",
    "read_cluster_id",
    "read_sync_node",
    "read_sync_nodes",
    "record_sync_order",
    "upsert_node_status",
]


# --- registration -------------------------------------------------------------------------


async def read_cluster_id(session: AsyncSession) -> str:
    result = await session.execute(text("SELECT cluster_id FROM cluster_info WHERE id = 1"))
    return str(result.scalar_one())


async def claim_or_insert_node(
    session: AsyncSession,
    *,
    node_id: uuid.UUID,
    name: str,
    credential_hash: bytes,
    approval_state: str,
    pool: str,
    token_id: str,
) -> tuple[uuid.UUID, str] | None:
    """Create the node row, or claim one an admin created without a credential.

    Returns the node's id and approval state, or None when the name belongs to a node that
    has a credential (registered before): only an admin may hand a name over, by deleting
    that node, since a second machine taking it would receive the first one's shards.
    """
    inserted = await session.execute(
        text(
            "INSERT INTO nodes (id, name, credential_hash, approval_state, pool, "
            "bootstrap_token_id) VALUES (:id, :name, :hash, :approval, :pool, :token) "
            "ON CONFLICT (name) DO NOTHING RETURNING id, approval_state"
        ),
        {
            "id": node_id,
            "name": name,
            "hash": credential_hash,
            "approval": approval_state,
            "pool": pool,
            "token": token_id,
        },
    )
    new = inserted.one_or_none()
    if new is not None:
        return uuid.UUID(str(new.id)), str(new.approval_state)
    # An admin-made row keeps its id, labels and an approval it already has.
    claimed = await session.execute(
        text(
            "UPDATE nodes SET credential_hash = :hash, bootstrap_token_id = :token, pool = :pool, "
            "approval_state = CASE WHEN approval_state = 'approved' THEN 'approved' "
            "ELSE :approval END "
            "WHERE name = :name AND credential_hash IS NULL RETURNING id, approval_state"
        ),
        {
            "name": name,
            "hash": credential_hash,
            "approval": approval_state,
            "pool": pool,
            "token": token_id,
        },
    )
    got = claimed.one_or_none()
    return None if got is None else (uuid.UUID(str(got.id)), str(got.approval_state))


async def upsert_node_status(
    session: AsyncSession,
    node_id: uuid.UUID,
    *,
    mgmt_addr: str,
    inventory: NodeInventory,
    agent_version: str,
) -> None:
    """The agent's half of a node at registration; its order (epoch, seq) starts at (0, 0)."""
    await session.execute(
        text(
            "INSERT INTO node_status (node_id, mgmt_addr, inventory, agent_version) "
            "VALUES (:id, :addr, CAST(:inv AS jsonb), :ver) "
            "ON CONFLICT (node_id) DO UPDATE SET mgmt_addr = EXCLUDED.mgmt_addr, "
            "inventory = EXCLUDED.inventory, agent_version = EXCLUDED.agent_version"
        ),
        {
            "id": node_id,
            "addr": mgmt_addr,
            "inv": inventory.model_dump_json(),
            "ver": agent_version,
        },
    )


# --- sync ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyncNode:
    """One node as a sync needs it: who it is, what it may do, and the order it holds."""

    id: uuid.UUID
    credential_hash: bytes | None
    approval_state: str
    draining: bool
    desired_version: int
    agent_epoch: int
    agent_seq: int


_SYNC_NODE_SQL = (
    "SELECT n.id, n.credential_hash, n.approval_state, n.draining, n.desired_version, "
    "coalesce(s.agent_epoch, 0) AS agent_epoch, coalesce(s.agent_seq, 0) AS agent_seq "
    "FROM nodes n LEFT JOIN node_status s ON s.node_id = n.id"
)


def _sync_node(row: Any) -> SyncNode:
    return SyncNode(
        id=uuid.UUID(str(row.id)),
        credential_hash=None if row.credential_hash is None else bytes(row.credential_hash),
        approval_state=row.approval_state,
        draining=bool(row.draining),
        desired_version=int(row.desired_version),
        agent_epoch=int(row.agent_epoch),
        agent_seq=int(row.agent_seq),
    )


async def read_sync_node(session: AsyncSession, node_id: uuid.UUID) -> SyncNode | None:
    """One node, fresh (None: no such node)."""
    result = await session.execute(text(f"{_SYNC_NODE_SQL} WHERE n.id = :id"), {"id": node_id})
    row = result.one_or_none()
    return None if row is None else _sync_node(row)


async def read_sync_nodes(session: AsyncSession) -> list[SyncNode]:
    """Every registered node as sync needs it: one statement for the whole fleet, so that
    unchanged syncs are answered from memory (``agentapi.nodes.NodeTable``)."""
    result = await session.execute(text(f"{_SYNC_NODE_SQL} WHERE n.credential_hash IS NOT NULL"))
    return [_sync_node(r) for r in result]


async def record_sync_order(
    session: AsyncSession,
    node_id: uuid.UUID,
    *,
    epoch: int,
    seq: int,
    at: datetime,
    inventory: NodeInventory | None,
) -> bool:
    """Move the node's (epoch, seq) forward and stamp the sync; False when the request is not
    newer than what is held (a delayed request of an older agent run, or a duplicate): then
    nothing is written and the caller must not apply its bindings either.

    The row lock this takes also serialises two syncs of one node in flight at once.
    """
    result = await session.execute(
        text(
            "INSERT INTO node_status (node_id, agent_epoch, agent_seq, last_sync_at, inventory) "
            "VALUES (:id, :e, :s, :t, coalesce(CAST(:inv AS jsonb), '{}'::jsonb)) "
            "ON CONFLICT (node_id) DO UPDATE SET agent_epoch = EXCLUDED.agent_epoch, "
            "agent_seq = EXCLUDED.agent_seq, last_sync_at = EXCLUDED.last_sync_at, "
            "inventory = CASE WHEN CAST(:inv AS jsonb) IS NULL THEN node_status.inventory "
            "ELSE EXCLUDED.inventory END "
            "WHERE (node_status.agent_epoch, node_status.agent_seq) < "
            "(EXCLUDED.agent_epoch, EXCLUDED.agent_seq) "
            "RETURNING node_id"
        ),
        {
            "id": node_id,
            "e": epoch,
            "s": seq,
            "t": at,
            "inv": None if inventory is None else inventory.model_dump_json(),
        },
    )
    return result.scalar_one_or_none() is not None


# --- heartbeats and the desired version ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Heartbeat:
    node_id: uuid.UUID
    epoch: int
    seq: int
    at: datetime


async def flush_heartbeats(session: AsyncSession, beats: Sequence[Heartbeat]) -> int:
    """One UPDATE for a batch of unchanged syncs; returns the rows it moved.

    Order is respected row by row: a beat older than what a changed sync already wrote
    (or another control plane's beat) is skipped, so last_sync_at and (epoch, seq) never
    go backwards. Rows are sent in node id order, so two instances flushing at once lock
    the rows in one order and cannot deadlock.
    """
    if not beats:
        return 0
    rows = [
        {"node_id": str(b.node_id), "e": b.epoch, "s": b.seq, "t": b.at.isoformat()}
        for b in sorted(beats, key=lambda b: b.node_id)
    ]
    result = await session.execute(
        text(
            "UPDATE node_status AS ns SET last_sync_at = v.t, agent_epoch = v.e, agent_seq = v.s "
            "FROM jsonb_to_recordset(CAST(:rows AS jsonb)) "
            "AS v(node_id uuid, e bigint, s bigint, t timestamptz) "
            "WHERE ns.node_id = v.node_id AND (ns.agent_epoch, ns.agent_seq) < (v.e, v.s)"
        ),
        {"rows": jsonb_rows(rows)},
    )
    return int(getattr(result, "rowcount", 0) or 0)


async def bump_desired_version(session: AsyncSession, node_id: uuid.UUID) -> int:
    """Bump the node's ETag after its report released shards; returns the new version."""
    result = await session.execute(
        text(
            "UPDATE nodes SET desired_version = desired_version + 1 WHERE id = :id "
            "RETURNING desired_version"
        ),
        {"id": node_id},
    )
    return int(result.scalar_one())
