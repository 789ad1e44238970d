"""The agent's half of a shard, and what the agent API reads of shards: the bindings an
agent reports, the release of stopped shards it reports gone, a node's desired set, and the
placed-shard map the KV intake reads.

Functions take a session, flush, and never commit: the caller owns the transaction.

Of ``shards`` only the binding columns are written here (``observed_adapters`` among them,
only where it changed), and ``released`` by the one rule an agent's report decides: a shard desired ``stopped`` whose engine the agent reports gone is
released (``release_stopped_shards``). The desired half (placement, ``desired_state``) is the
reconciler's.

This module must not import FastAPI or the node agent, or log secrets (a desired shard's
engine key is read here, for the node that runs it only).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.engines.kv_capacity import kv_capacity_blocks
from llmgw.protocol.sync import ShardBinding
from llmgw.store.bulk import jsonb_rows

__all__ = [
    "GONE_STATES",
    "DesiredShardRow",
    "PlacedRow",
    "apply_bindings",
    "apply_observed_adapters",
    "kv_capacity_blocks",
    "read_desired_shards",
    "read_live_shard_ids",
    "read_placed",
    "release_stopped_shards",
    "stopped_shards_gone",
]

# A binding's states that mean "no process of this shard runs".
GONE_STATES = ("exited", "failed")


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
        {"rows": jsonb_rows(rows), "node": node_id},
    )
    return {uuid.UUID(str(r)) for r in result.scalars()}


async def apply_observed_adapters(
    session: AsyncSession,
    node_id: uuid.UUID,
    bindings: Iterable[tuple[uuid.UUID, ShardBinding]],
) -> set[uuid.UUID]:
    """Store the runtime adapters the agent reports on the node's OWN shards where they differ
    from what is stored; returns the shards whose value changed.

    ``IS DISTINCT FROM``: a row is rewritten only when its adapters changed (the route table
    re-reads on a change of this column: an adapter loaded or gone is a route added or gone),
    never on every report. Entries are stored in name order, so one set reported in another
    order is no change. Run after ``apply_bindings`` in the same transaction (whose statement
    has already woken the route caches for this sync: a NOTIFY is delivered once per
    transaction and channel).
    """
    rows = [
        {
            "id": str(sid),
            "adapters": [
                a.model_dump(mode="json") for a in sorted(b.adapters, key=lambda a: a.name)
            ],
        }
        for sid, b in sorted(bindings, key=lambda p: p[0])
    ]
    if not rows:
        return set()
    result = await session.execute(
        text(
            "UPDATE shards AS s SET observed_adapters = v.adapters "
            "FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS v(id uuid, adapters jsonb) "
            "WHERE s.id = v.id AND s.node_id = :node "
            "AND s.observed_adapters IS DISTINCT FROM v.adapters RETURNING s.id"
        ),
        {"rows": jsonb_rows(rows), "node": node_id},
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
    # The runtime adapters the leader placed on its engine, as stored ([{"name", "path",
    # "pinned"}]); rank 0 only, empty for the other ranks.
    adapters: tuple[dict[str, Any], ...] = ()


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
            "coalesce(g.indices, '{}') AS indices, coalesce(g.migs, '{}') AS migs, "
            "CASE WHEN s.rank = 0 THEN s.desired_adapters END AS adapters "
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
            adapters=tuple(a for a in r.adapters or () if isinstance(a, dict)),
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
    # The engine's KV capacity in blocks when its launched profile fixes it
    # (``engines.kv_capacity``): the bound of the shard's KV view. None: unknown.
    max_blocks: int | None = None


async def read_placed(session: AsyncSession) -> list[PlacedRow]:
    """Every live shard's node, model and KV block size: the KV intake's ``placed`` map."""
    result = await session.execute(
        text(
            "SELECT s.id, s.node_id, "
            "coalesce(m.name, s.launch_spec #>> '{profile,model}', '') AS model, "
            "CASE WHEN (s.launch_spec #>> '{profile,kv_events}') = 'true' "
            "THEN (s.launch_spec #>> '{profile,kv_hash,block_size}') END AS block_size, "
            "s.launch_spec -> 'profile' AS profile "
            "FROM shards s JOIN replicas r ON r.id = s.replica_id "
            "LEFT JOIN deployments d ON d.id = r.deployment_id "
            "LEFT JOIN models m ON m.id = d.model_id WHERE NOT s.released"
        )
    )
    return [_placed_row(r.id, r.node_id, r.model, r.block_size, r.profile) for r in result]


def _placed_row(
    shard: Any, node: Any, model: str, block_size: str | None, profile: object
) -> PlacedRow:
    size: int | None = None
    if block_size is not None and block_size.isdigit():
        size = int(block_size)
    capacity = kv_capacity_blocks(profile) if isinstance(profile, dict) else None
    return PlacedRow(uuid.UUID(str(shard)), uuid.UUID(str(node)), model, size, capacity)
