"""Every SQL statement of the agent API (registration, sync, heartbeats, the placed-shard map).

Functions take a session, flush, and never commit: the caller owns the transaction
(``async with session.begin():``), so a refused registration or a sync that fails half-way
leaves nothing behind, and in-memory caches are updated only after the commit.

The agent's half of the state (``node_status``, the binding columns of ``shards``) is written
only here; the desired half (``shards``' placement, ``nodes.desired_version``) belongs to the
reconciler, except for one rule the agent's report decides: a shard desired ``stopped`` whose
engine the agent reports gone is released (``release_stopped_shards``).

Bulk writes pass their rows as one JSONB parameter expanded by ``jsonb_to_recordset``: one
statement and one round trip however many rows, with the types spelled out in SQL.

This module must not import FastAPI or the node agent, or log secrets.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.agentapi.credentials import new_bootstrap_token, secret_sha256
from llmgw.controlplane.store.tables import BootstrapToken
from llmgw.errors import SpecError
from llmgw.protocol.sync import NodeInventory, ShardBinding

__all__ = [
    "GONE_STATES",
    "DesiredShardRow",
    "Heartbeat",
    "PlacedRow",
    "SyncNode",
    "TokenGrant",
    "apply_bindings",
    "bump_desired_version",
    "claim_or_insert_node",
    "consume_bootstrap_token",
    "create_bootstrap_token",
    "flush_heartbeats",
    "read_bootstrap_token_hash",
    "read_cluster_id",
    "read_desired_shards",
    "read_live_shard_ids",
    "read_placed",
    "read_sync_node",
    "read_sync_nodes",
    "record_sync_order",
    "release_stopped_shards",
    "stopped_shards_gone",
    "upsert_node_status",
]

# A binding's states that mean "no process of this shard runs".
GONE_STATES = ("exited", "failed")


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


# --- bootstrap tokens -------------------------------------------------------------


async def create_bootstrap_token(
    session: AsyncSession,
    *,
    pool: str = "default",
    ttl_s: float,
    uses: int | None,
    require_approval: bool = False,
    description: str = "",
) -> tuple[BootstrapToken, str]:
    """A new bootstrap token row and its plaintext (shown once; only its hash is stored).

    ``uses`` None: any number of nodes until it expires.
    """
    if ttl_s <= 0:
        raise SpecError(
            f"bootstrap token ttl_s {ttl_s} must be positive: a token that never expires is a "
            "standing invitation to join the cluster; give it the hours the rollout needs",
            field="ttl_s",
        )
    if uses is not None and uses < 1:
        raise SpecError(
            f"bootstrap token uses {uses} must be at least 1 (or unset for no limit)",
            field="uses",
        )
    token = new_bootstrap_token()
    row = BootstrapToken(
        id=token.id,
        secret_sha256=secret_sha256(token.secret),
        description=description,
        pool=pool,
        require_approval=require_approval,
        expires_at=datetime.now(UTC) + timedelta(seconds=ttl_s),
        uses_left=uses,
    )
    session.add(row)
    await session.flush()
    return row, token.plaintext


async def read_bootstrap_token_hash(session: AsyncSession, token_id: str) -> bytes | None:
    """The stored hash of the token's secret (None: no such token)."""
    result = await session.execute(
        text("SELECT secret_sha256 FROM bootstrap_tokens WHERE id = :id"), {"id": token_id}
    )
    value = result.scalar_one_or_none()
    return None if value is None else bytes(value)


@dataclass(frozen=True, slots=True)
class TokenGrant:
    """What a consumed bootstrap token gives the node."""

    token_id: str
    pool: str
    require_approval: bool


async def consume_bootstrap_token(session: AsyncSession, token_id: str) -> TokenGrant | None:
    """Take one use of a live token, atomically; None when it is revoked, expired or used up.

    One conditional UPDATE: two registrations racing for a token's last use cannot both
    get it (the second waits on the row lock, then its WHERE no longer matches).
    """
    result = await session.execute(
        text(
            "UPDATE bootstrap_tokens SET uses_left = uses_left - 1 "
            "WHERE id = :id AND NOT revoked AND expires_at > now() "
            "AND (uses_left IS NULL OR uses_left > 0) "
            "RETURNING pool, require_approval"
        ),
        {"id": token_id},
    )
    row = result.one_or_none()
    if row is None:
        return None
    return TokenGrant(token_id=token_id, pool=row.pool, require_approval=bool(row.require_approval))


# --- nodes ------------------------------------------------------------------------------


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

    Returns the node's id and approval state, or None when the name belongs to a node that has a credential
    (registered before): only an admin may hand a name over, by deleting that node, since a
    second machine taking it would receive the first one's shards.
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
        {"rows": _json(rows)},
    )
    return int(getattr(result, "rowcount", 0) or 0)


async def bump_desired_version(session: AsyncSession, node_id: uuid.UUID) -> int:
    result = await session.execute(
        text(
            "UPDATE nodes SET desired_version = desired_version + 1 WHERE id = :id "
            "RETURNING desired_version"
        ),
        {"id": node_id},
    )
    return int(result.scalar_one())


# --- shards: the agent's half -------------------------------------------------------------


def _binding_row(b: ShardBinding, shard_id: uuid.UUID) -> dict[str, Any]:
    return {
        "id": str(shard_id),
        "http_port": b.http_port or None,
        "kv_events_port": b.kv_events_port or None,
        "kv_replay_port": b.kv_replay_port or None,
        "pid": b.pid,
        "boot_id": b.boot_id or None,
        "process_start_time": b.process_start_time,
        "engine_version": b.engine_version or None,
        "observed_state": b.observed_state,
        "observed_reason": b.reason,
        "observed_fingerprint": b.fingerprint,
        "proxy_url": b.proxy_url,
        "log_tail": b.log_tail,
        "restarts": b.restarts,
        "exit_code": b.exit_code,
        "started_at": None
        if b.started_at is None
        else datetime.fromtimestamp(b.started_at, UTC).isoformat(),
    }


async def apply_bindings(
    session: AsyncSession,
    node_id: uuid.UUID,
    bindings: Iterable[tuple[uuid.UUID, ShardBinding]],
) -> set[uuid.UUID]:
    """Write the bindings of the node's OWN shards; returns the ids written.

    ``AND s.node_id = :node`` is the rule that a node reports only on its own shards: a
    binding naming another node's shard (or none) matches no row and is dropped, and the
    caller counts the difference. ``exited_at`` is stamped when a shard first goes from
    running to gone.
    """
    rows = [_binding_row(b, sid) for sid, b in sorted(bindings, key=lambda p: p[0])]
    if not rows:
        return set()
    result = await session.execute(
        text(
            "UPDATE shards AS s SET http_port = v.http_port, kv_events_port = v.kv_events_port, "
            "kv_replay_port = v.kv_replay_port, pid = v.pid, boot_id = v.boot_id, "
            "process_start_time = v.process_start_time, engine_version = v.engine_version, "
            "observed_state = v.observed_state, observed_reason = v.observed_reason, "
            "observed_fingerprint = v.observed_fingerprint, proxy_url = v.proxy_url, "
            "log_tail = v.log_tail, restarts = v.restarts, exit_code = v.exit_code, "
            "started_at = v.started_at, observed_at = now(), "
            "exited_at = CASE WHEN v.observed_state IN ('exited', 'failed') "
            "AND s.observed_state NOT IN ('exited', 'failed') THEN now() "
            "WHEN v.observed_state IN ('exited', 'failed') THEN s.exited_at ELSE NULL END "
            "FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS v(id uuid, http_port int, "
            "kv_events_port int, kv_replay_port int, pid int, boot_id text, "
            "process_start_time bigint, engine_version text, observed_state text, "
            "observed_reason text, observed_fingerprint text, proxy_url text, log_tail text, "
            "restarts int, exit_code int, started_at timestamptz) "
            "WHERE s.id = v.id AND s.node_id = :node RETURNING s.id"
        ),
        {"rows": _json(rows), "node": node_id},
    )
    return {uuid.UUID(str(r)) for r in result.scalars()}


# A node's shard desired stopped whose engine its agent no longer reports running.
_STOPPED_AND_GONE = (
    "node_id = :node AND NOT released AND desired_state = 'stopped' "
    "AND NOT (id = ANY(CAST(:running AS uuid[])))"
)


async def release_stopped_shards(
    session: AsyncSession, node_id: uuid.UUID, running: Iterable[uuid.UUID]
) -> list[uuid.UUID]:
    """Release the node's shards desired ``stopped`` whose engine the agent reports gone.

    Gone: reported ``exited``/``failed``, or not reported at all (the agent reports every
    shard it knows on every sync). ``running`` are the shards it reported in any other
    state. Released frees the GPUs (gpu_assignments follow through ON UPDATE CASCADE) and
    the leader port; the caller bumps the node's desired_version so the agent drops them.
    """
    result = await session.execute(
        text(f"UPDATE shards SET released = true WHERE {_STOPPED_AND_GONE} RETURNING id"),
        {"node": node_id, "running": sorted(str(s) for s in running)},
    )
    return sorted(uuid.UUID(str(r)) for r in result.scalars())


async def stopped_shards_gone(
    session: AsyncSession, node_id: uuid.UUID, running: Iterable[uuid.UUID]
) -> list[uuid.UUID]:
    """The shards ``release_stopped_shards`` would release: read-only, for a report that may
    not release them yet (its agent has not applied the set that stops them)."""
    result = await session.execute(
        text(f"SELECT id FROM shards WHERE {_STOPPED_AND_GONE}"),
        {"node": node_id, "running": sorted(str(s) for s in running)},
    )
    return sorted(uuid.UUID(str(r)) for r in result.scalars())


@dataclass(frozen=True, slots=True)
class DesiredShardRow:
    id: uuid.UUID
    replica_id: uuid.UUID
    rank: int
    desired_state: str
    fingerprint: str
    launch_spec: dict[str, Any]
    engine_api_key: str
    hcas: tuple[str, ...]
    leader_port: int | None
    model: str
    # The shard's devices in order (gpu_assignments by position).
    gpu_indices: tuple[int, ...]
    mig_uuids: tuple[str | None, ...]


async def read_desired_shards(session: AsyncSession, node_id: uuid.UUID) -> list[DesiredShardRow]:
    """The node's complete desired set: its shards not released, with their GPUs and model.

    One statement: the devices are aggregated per shard in order of position; the model's
    name comes through the replica's deployment (NULL once the deployment is deleted: then
    the name the launch spec carries).
    """
    result = await session.execute(
        text(
            "SELECT s.id, s.replica_id, s.rank, s.desired_state, s.profile_fingerprint, "
            "s.launch_spec, s.engine_api_key, s.hcas, s.leader_port, "
            "coalesce(m.name, s.launch_spec #>> '{profile,model}', '') AS model, "
            "coalesce(g.indices, '{}') AS indices, coalesce(g.migs, '{}') AS migs "
            "FROM shards s JOIN replicas r ON r.id = s.replica_id "
            "LEFT JOIN deployments d ON d.id = r.deployment_id "
            "LEFT JOIN models m ON m.id = d.model_id "
            "LEFT JOIN LATERAL (SELECT array_agg(a.gpu_index ORDER BY a.position) AS indices, "
            "array_agg(a.mig_uuid ORDER BY a.position) AS migs "
            "FROM gpu_assignments a WHERE a.shard_id = s.id) g ON true "
            "WHERE s.node_id = :node AND NOT s.released ORDER BY s.id"
        ),
        {"node": node_id},
    )
    return [
        DesiredShardRow(
            id=uuid.UUID(str(r.id)),
            replica_id=uuid.UUID(str(r.replica_id)),
            rank=int(r.rank),
            desired_state=r.desired_state,
            fingerprint=r.profile_fingerprint,
            launch_spec=dict(r.launch_spec or {}),
            engine_api_key=r.engine_api_key,
            hcas=tuple(r.hcas or ()),
            leader_port=r.leader_port,
            model=r.model,
            gpu_indices=tuple(int(i) for i in r.indices),
            mig_uuids=tuple(r.migs),
        )
        for r in result
    ]


async def read_live_shard_ids(session: AsyncSession, node_id: uuid.UUID) -> frozenset[uuid.UUID]:
    result = await session.execute(
        text("SELECT id FROM shards WHERE node_id = :node AND NOT released"), {"node": node_id}
    )
    return frozenset(uuid.UUID(str(r)) for r in result.scalars())


@dataclass(frozen=True, slots=True)
class PlacedRow:
    shard_id: uuid.UUID
    node_id: uuid.UUID
    model: str
    # The profile's KV block size when it publishes KV events; None otherwise.
    block_size: int | None


async def read_placed(session: AsyncSession) -> list[PlacedRow]:
    """Every live shard's node, model and KV block size: the KV intake's ``placed`` map."""
    result = await session.execute(
        text(
            "SELECT s.id, s.node_id, "
            "coalesce(m.name, s.launch_spec #>> '{profile,model}', '') AS model, "
            "CASE WHEN (s.launch_spec #>> '{profile,kv_events}') = 'true' "
            "THEN (s.launch_spec #>> '{profile,kv_hash,block_size}') END AS block_size "
            "FROM shards s JOIN replicas r ON r.id = s.replica_id "
            "LEFT JOIN deployments d ON d.id = r.deployment_id "
            "LEFT JOIN models m ON m.id = d.model_id WHERE NOT s.released"
        )
    )
    return [_placed_row(r.id, r.node_id, r.model, r.block_size) for r in result]


def _placed_row(shard: Any, node: Any, model: str, block_size: str | None) -> PlacedRow:
    size: int | None = None
    if block_size is not None and block_size.isdigit():
        size = int(block_size)
    return PlacedRow(uuid.UUID(str(shard)), uuid.UUID(str(node)), model, size)
