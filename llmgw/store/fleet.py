"""The admin API's SQL for the fleet: nodes, replicas, the reconciler's action record, GPU
classes (bootstrap tokens are ``bootstrap_tokens.py``'s).

As ``llmgw.store.catalog``: functions take a session, flush, never commit, and
raise ``llmgw.errors`` types. Lists read a page in a constant number of statements (the
page, then its children with ``IN``), never one query per row.

What this module must not do: write the agent's half of a row (``node_status``, shards'
binding columns) or the reconciler's (``deployment_status``, shards' desired half); an
admin's drain is a flag the reconciler acts on, not a change to shards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.errors import ConflictError, NotFoundError, SpecError
from llmgw.store.catalog import one_by_name
from llmgw.store.tables import (
    Deployment,
    DeploymentStatus,
    GpuAssignment,
    GpuClass,
    Node,
    NodeStatus,
    Profile,
    ReconcileAction,
    Replica,
    Shard,
)

__all__ = [
    "NodeRow",
    "ReplicaRow",
    "delete_gpu_class",
    "delete_node",
    "get_gpu_class",
    "get_node",
    "get_replica",
    "gpu_class_exists",
    "list_actions",
    "list_gpu_classes",
    "list_nodes",
    "list_replicas",
    "lock_node",
]


# --- nodes ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeRow:
    node: Node
    status: NodeStatus | None
    # (gpu_index, mig_uuid) of every GPU a live shard holds here.
    held: frozenset[tuple[int, str | None]]
    num_shards: int


async def _node_rows(
    session: AsyncSession, nodes: Sequence[tuple[Node, NodeStatus | None]]
) -> list[NodeRow]:
    ids = [n.id for n, _ in nodes]
    held: dict[uuid.UUID, set[tuple[int, str | None]]] = {i: set() for i in ids}
    counts: dict[uuid.UUID, int] = dict.fromkeys(ids, 0)
    if ids:
        gpus = await session.execute(
            select(GpuAssignment.node_id, GpuAssignment.gpu_index, GpuAssignment.mig_uuid).where(
                GpuAssignment.node_id.in_(ids), GpuAssignment.shard_released.is_(False)
            )
        )
        for node_id, index, mig in gpus.all():
            held[node_id].add((index, mig))
        shards = await session.execute(
            select(Shard.node_id, func.count())
            .where(Shard.node_id.in_(ids), Shard.released.is_(False))
            .group_by(Shard.node_id)
        )
        for node_id, count in shards.all():
            counts[node_id] = int(count)
    return [NodeRow(n, st, frozenset(held[n.id]), counts[n.id]) for n, st in nodes]


async def list_nodes(session: AsyncSession, *, after: str | None, limit: int) -> list[NodeRow]:
    """Nodes in name order with what their agents report; three statements a page."""
    stmt = (
        select(Node, NodeStatus)
        .outerjoin(NodeStatus, NodeStatus.node_id == Node.id)
        .order_by(Node.name)
        .limit(limit)
    )
    if after is not None:
        stmt = stmt.where(Node.name > after)
    return await _node_rows(session, [(n, st) for n, st in (await session.execute(stmt)).all()])


def _no_node(name: str) -> NotFoundError:
    return NotFoundError(
        f"node {name!r} does not exist; list them with GET /admin/v1/nodes (a node appears "
        "when its agent registers with a bootstrap token)",
        field="name",
    )


async def get_node(session: AsyncSession, name: str) -> NodeRow:
    row = (
        await session.execute(
            select(Node, NodeStatus)
            .outerjoin(NodeStatus, NodeStatus.node_id == Node.id)
            .where(Node.name == name)
        )
    ).one_or_none()
    if row is None:
        raise _no_node(name)
    return (await _node_rows(session, [(row[0], row[1])]))[0]


async def lock_node(session: AsyncSession, name: str) -> Node:
    """The node row locked FOR UPDATE (the admins' half only: heartbeats never wait on it)."""
    node = (
        await session.execute(select(Node).where(Node.name == name).with_for_update())
    ).scalar_one_or_none()
    if node is None:
        raise _no_node(name)
    return node


async def delete_node(session: AsyncSession, name: str) -> Node:
    """Delete a node that holds no live shard; refused (409) naming them otherwise.

    Its released shards (engines reported gone) are deleted with it: they only said what
    the node once ran, and the shards' RESTRICT key would otherwise keep a drained node
    forever.
    """
    node = await lock_node(session, name)
    live = (
        await session.execute(
            select(Shard.id, Shard.rank, Deployment.name)
            .join(Replica, Shard.replica_id == Replica.id)
            .outerjoin(Deployment, Replica.deployment_id == Deployment.id)
            .where(Shard.node_id == node.id, Shard.released.is_(False))
            .order_by(Deployment.name, Shard.id)
        )
    ).all()
    if live:
        listed = ", ".join(
            f"{dep or '(deleted deployment)'} shard {str(sid)[:8]} rank {rank}"
            for sid, rank, dep in live[:10]
        )
        more = f" and {len(live) - 10} more" if len(live) > 10 else ""
        raise ConflictError(
            f"node {name!r} still holds {len(live)} live shard(s): {listed}{more}; drain it "
            f"first (POST /admin/v1/nodes/{name}/drain, or `llmgw nodes drain {name}`) and "
            "delete it once its shards are released",
            field="name",
        )
    await session.execute(delete(Shard).where(Shard.node_id == node.id))
    await session.delete(node)
    await session.flush()
    return node


# --- replicas ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    replica: Replica
    deployment: str | None
    current_fingerprint: str | None
    deployment_reason: str
    # (shard, node name, [(gpu_index, mig_uuid) in device order]), by rank.
    shards: tuple[tuple[Shard, str, tuple[tuple[int, str | None], ...]], ...]


def _replica_stmt() -> Any:
    return (
        select(Replica, Deployment.name, Profile.fingerprint, DeploymentStatus.reason)
        .outerjoin(Deployment, Replica.deployment_id == Deployment.id)
        .outerjoin(Profile, Deployment.profile_id == Profile.id)
        .outerjoin(DeploymentStatus, DeploymentStatus.deployment_id == Deployment.id)
    )


async def _replica_rows(session: AsyncSession, rows: Iterable[Any]) -> list[ReplicaRow]:
    rows = list(rows)
    ids = [r[0].id for r in rows]
    by_replica: dict[uuid.UUID, list[tuple[Shard, str]]] = {i: [] for i in ids}
    gpus: dict[uuid.UUID, list[tuple[int, str | None]]] = {}
    if ids:
        shards = await session.execute(
            select(Shard, Node.name)
            .join(Node, Shard.node_id == Node.id)
            .where(Shard.replica_id.in_(ids))
            .order_by(Shard.replica_id, Shard.rank)
        )
        for shard, node in shards.all():
            by_replica[shard.replica_id].append((shard, node))
        shard_ids = [s.id for pairs in by_replica.values() for s, _ in pairs]
        if shard_ids:
            held = await session.execute(
                select(GpuAssignment.shard_id, GpuAssignment.gpu_index, GpuAssignment.mig_uuid)
                .where(GpuAssignment.shard_id.in_(shard_ids))
                .order_by(GpuAssignment.shard_id, GpuAssignment.position)
            )
            for shard_id, index, mig in held.all():
                gpus.setdefault(shard_id, []).append((index, mig))
    return [
        ReplicaRow(
            replica=r[0],
            deployment=r[1],
            current_fingerprint=r[2],
            deployment_reason=r[3] or "",
            shards=tuple((s, n, tuple(gpus.get(s.id, ()))) for s, n in by_replica[r[0].id]),
        )
        for r in rows
    ]


async def list_replicas(
    session: AsyncSession, *, deployment: str | None, after: str | None, limit: int
) -> list[ReplicaRow]:
    """Replicas in id order (keyset), optionally of one deployment; three statements a page."""
    stmt = _replica_stmt().order_by(Replica.id).limit(limit)
    if deployment is not None:
        stmt = stmt.where(Deployment.name == deployment)
    if after is not None:
        stmt = stmt.where(Replica.id > _uuid(after, "cursor"))
    return await _replica_rows(session, (await session.execute(stmt)).all())


def _uuid(value: str, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise SpecError(
            f"{value!r} is not a replica id (a UUID, as GET /admin/v1/replicas lists them)",
            field=field,
        ) from None


async def get_replica(session: AsyncSession, replica_id: str) -> ReplicaRow:
    rid = _uuid(replica_id, "id")
    rows = (await session.execute(_replica_stmt().where(Replica.id == rid))).all()
    if not rows:
        raise NotFoundError(
            f"replica {replica_id!r} does not exist (a replica that stopped is gone); list "
            "them with GET /admin/v1/replicas",
            field="id",
        )
    return (await _replica_rows(session, rows))[0]


# --- actions ----------------------------------------------------------------


async def list_actions(
    session: AsyncSession, *, deployment: str | None, before_id: int | None, limit: int
) -> Sequence[ReconcileAction]:
    """The reconciler's actions, newest first (keyset on id, descending)."""
    stmt = select(ReconcileAction).order_by(ReconcileAction.id.desc()).limit(limit)
    if deployment is not None:
        stmt = stmt.where(ReconcileAction.deployment == deployment)
    if before_id is not None:
        stmt = stmt.where(ReconcileAction.id < before_id)
    return (await session.execute(stmt)).scalars().all()


# --- GPU classes ------------------------------------------------------------


async def list_gpu_classes(
    session: AsyncSession, *, after: str | None, limit: int
) -> Sequence[GpuClass]:
    stmt = select(GpuClass).order_by(GpuClass.name).limit(limit)
    if after is not None:
        stmt = stmt.where(GpuClass.name > after)
    return (await session.execute(stmt)).scalars().all()


async def gpu_class_exists(session: AsyncSession, name: str) -> bool:
    found = await session.execute(select(GpuClass.name).where(GpuClass.name == name))
    return found.scalar_one_or_none() is not None


async def get_gpu_class(session: AsyncSession, name: str, *, lock: bool = False) -> GpuClass:
    missing = f"GPU class {name!r} does not exist; list them with GET /admin/v1/gpu-classes"
    return await one_by_name(session, GpuClass, name, missing=missing, lock=lock)


async def delete_gpu_class(session: AsyncSession, name: str) -> GpuClass:
    """Delete a class no profile names; refused (409) naming the profiles otherwise, since
    their replicas would become unplaceable."""
    row = await get_gpu_class(session, name, lock=True)
    users = (
        (
            await session.execute(
                select(Profile.name).where(Profile.gpu_class == name).order_by(Profile.name)
            )
        )
        .scalars()
        .all()
    )
    if users:
        listed = ", ".join(repr(n) for n in users[:10])
        more = f" and {len(users) - 10} more" if len(users) > 10 else ""
        raise ConflictError(
            f"GPU class {name!r} is named by profile(s) {listed}{more}, whose replicas could "
            "then be placed nowhere; point them at another class first",
            field="name",
        )
    await session.delete(row)
    await session.flush()
    return row
