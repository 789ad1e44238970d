"""The SQL of runtime adapters' placement: what the leader's pass reads (the declared adapters
with their last status; their demand is ``demand``'s rows under their names) and writes
(rank-0 shards' ``desired_adapters`` with their nodes' ``desired_version``,
``adapter_status``), and the status the admin API reads back (the leader's count and reason,
where each adapter is desired, loaded or failing).

Functions take a session and never commit: the leader's writes run in its fenced pass, the
admin's reads in its request. Every read here is one statement whatever the fleet's size.
The agents' half (``shards.observed_adapters``) is written by ``agent_shards``.

What this module must NOT do: decide where an adapter goes (``planner.adapter_pass``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.store.bulk import jsonb_rows

__all__ = [
    "AdapterFailure",
    "AdapterHolder",
    "AdapterStatusRow",
    "DeclaredAdapterRow",
    "read_adapter_status",
    "read_declared_adapters",
    "write_adapter_status",
    "write_desired_adapters",
]


@dataclass(frozen=True, slots=True)
class DeclaredAdapterRow:
    name: str
    model: str
    path: str
    min_replicas: int | None
    max_replicas: int | None
    pinned: bool
    # The leader's last status (adapter_status); None: it has written none yet.
    desired_replicas: int | None = None
    unplaced: str = ""


async def read_declared_adapters(session: AsyncSession) -> list[DeclaredAdapterRow]:
    """Every declared adapter with its stored status, in name order."""
    result = await session.execute(
        text(
            "SELECT a.name, a.model, a.path, a.min_replicas, a.max_replicas, a.pinned, "
            "st.desired_replicas, coalesce(st.unplaced, '') AS unplaced "
            "FROM adapters a LEFT JOIN adapter_status st ON st.adapter = a.name ORDER BY a.name"
        )
    )
    return [
        DeclaredAdapterRow(
            name=r.name,
            model=r.model,
            path=r.path,
            min_replicas=r.min_replicas,
            max_replicas=r.max_replicas,
            pinned=r.pinned,
            desired_replicas=r.desired_replicas,
            unplaced=r.unplaced,
        )
        for r in result
    ]


async def write_desired_adapters(
    session: AsyncSession, shards: Sequence[tuple[uuid.UUID, Sequence[dict[str, Any]]]]
) -> list[uuid.UUID]:
    """Set rank-0 shards' ``desired_adapters`` ([{"name", "path", "pinned"}]) and bump the
    desired_version of every node whose shard changed, in one statement; returns those nodes.

    The bump is what carries the change to the agent (the sync's ETag); the launch spec and
    fingerprint are untouched, so no engine restarts. A shard released since the snapshot, or
    already holding the same list, is left alone and bumps nothing."""
    if not shards:
        return []
    rows = [{"id": str(sid), "adapters": list(adapters)} for sid, adapters in sorted(shards)]
    result = await session.execute(
        text(
            "WITH changed AS (UPDATE shards AS s SET desired_adapters = v.adapters "
            "FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS v(id uuid, adapters jsonb) "
            "WHERE s.id = v.id AND NOT s.released "
            "AND s.desired_adapters IS DISTINCT FROM v.adapters RETURNING s.node_id) "
            "UPDATE nodes SET desired_version = desired_version + 1 "
            "WHERE id IN (SELECT node_id FROM changed) RETURNING id"
        ),
        {"rows": jsonb_rows(rows)},
    )
    return sorted(uuid.UUID(str(r)) for r in result.scalars())


async def write_adapter_status(session: AsyncSession, rows: Sequence[tuple[str, int, str]]) -> None:
    """Upsert (adapter, desired_replicas, unplaced) rows; an adapter deleted since the pass
    read it is skipped (the join), not an error that fails the pass."""
    if not rows:
        return
    batch = [
        {"adapter": name, "desired_replicas": desired, "unplaced": unplaced[:4000]}
        for name, desired, unplaced in sorted(rows)
    ]
    await session.execute(
        text(
            "INSERT INTO adapter_status (adapter, desired_replicas, unplaced) "
            "SELECT v.adapter, v.desired_replicas, v.unplaced "
            "FROM jsonb_to_recordset(CAST(:rows AS jsonb)) "
            "AS v(adapter text, desired_replicas int, unplaced text) "
            "JOIN adapters a ON a.name = v.adapter "
            "ON CONFLICT (adapter) DO UPDATE SET desired_replicas = excluded.desired_replicas, "
            "unplaced = excluded.unplaced, updated_at = now()"
        ),
        {"rows": jsonb_rows(batch)},
    )


@dataclass(frozen=True, slots=True)
class AdapterHolder:
    replica_id: str
    node: str


@dataclass(frozen=True, slots=True)
class AdapterFailure:
    replica_id: str
    node: str
    reason: str
    # Failed loads in a row, as the agent counts them.
    failures: int


@dataclass(frozen=True, slots=True)
class AdapterStatusRow:
    """Where an adapter stands: the leader's count and reason, and the shards' word."""

    # None: the leader has not placed it yet (just declared, or no leader).
    desired_replicas: int | None = None
    unplaced: str = ""
    # Replicas whose engine is told to hold it, in replica id order.
    replicas: tuple[AdapterHolder, ...] = ()
    # Replicas whose agent reports it loaded.
    loaded: tuple[AdapterHolder, ...] = ()
    # Replicas whose agent reports its last load failed.
    failures: tuple[AdapterFailure, ...] = ()


# Every (adapter, shard) pair that names one of the adapters asked about, desired or observed:
# the live rank-0 shards' arrays unnested, so the cost follows the adapters' holders, not the
# fleet, and one statement answers a whole page.
_READ_HOLDERS = text(
    "SELECT e ->> 'name' AS adapter, 'desired' AS side, s.replica_id, n.name AS node, "
    "NULL AS state, NULL AS reason, NULL AS failures "
    "FROM shards s JOIN nodes n ON n.id = s.node_id "
    "CROSS JOIN LATERAL jsonb_array_elements(s.desired_adapters) AS e "
    "WHERE NOT s.released AND s.rank = 0 AND e ->> 'name' = ANY(CAST(:names AS text[])) "
    "UNION ALL SELECT e ->> 'name', 'observed', s.replica_id, n.name, e ->> 'state', "
    "e ->> 'reason', e ->> 'failures' "
    "FROM shards s JOIN nodes n ON n.id = s.node_id "
    "CROSS JOIN LATERAL jsonb_array_elements(s.observed_adapters) AS e "
    "WHERE NOT s.released AND s.rank = 0 AND e ->> 'name' = ANY(CAST(:names AS text[])) "
    "ORDER BY 1, 3"
)


async def read_adapter_status(
    session: AsyncSession, names: Sequence[str]
) -> dict[str, AdapterStatusRow]:
    """The status of each adapter named, in two statements (an adapter nobody placed yet gets
    the empty status)."""
    if not names:
        return {}
    wanted = sorted(set(names))
    stored = {
        r.adapter: (r.desired_replicas, r.unplaced)
        for r in await session.execute(
            text(
                "SELECT adapter, desired_replicas, unplaced FROM adapter_status "
                "WHERE adapter = ANY(CAST(:names AS text[]))"
            ),
            {"names": wanted},
        )
    }
    replicas: dict[str, list[AdapterHolder]] = {}
    loaded: dict[str, list[AdapterHolder]] = {}
    failures: dict[str, list[AdapterFailure]] = {}
    for r in await session.execute(_READ_HOLDERS, {"names": wanted}):
        holder = AdapterHolder(str(r.replica_id), r.node)
        if r.side == "desired":
            replicas.setdefault(r.adapter, []).append(holder)
        elif r.state == "loaded":
            loaded.setdefault(r.adapter, []).append(holder)
        elif r.state == "failed":
            count = int(r.failures) if r.failures and str(r.failures).isdigit() else 0
            failures.setdefault(r.adapter, []).append(
                AdapterFailure(holder.replica_id, holder.node, r.reason or "", count)
            )
    out: dict[str, AdapterStatusRow] = {}
    for name in wanted:
        desired, unplaced = stored.get(name, (None, ""))
        out[name] = AdapterStatusRow(
            desired_replicas=desired,
            unplaced=unplaced,
            replicas=tuple(replicas.get(name, ())),
            loaded=tuple(loaded.get(name, ())),
            failures=tuple(failures.get(name, ())),
        )
    return out
