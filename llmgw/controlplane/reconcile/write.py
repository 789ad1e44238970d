"""The reconcile pass's write: a plan's actions, in the caller's transaction.

``apply_plan`` runs inside the transaction that ``check_epoch`` opened, so a leader that lost
its lock writes nothing. Every node whose desired shards change gets its ``desired_version``
bumped in the same transaction: that is the ETag agents sync on, and a change without a bump
would never reach the node. Launch specs are built here from the stored profile, the
placement and the nodes' reported addresses; the GPUs themselves are written only as
``gpu_assignments`` rows (the one record of who holds which GPU), and the agent API adds them
to the spec it serves. Every action but a status update lands in ``reconcile_actions``, the
answer to "why did my replica restart?". The adapter placement's writes (``apply_adapters``)
follow the same rules: a rank-0 shard's new ``desired_adapters`` bumps its node's
desired_version in the same statement, and each load, unload and count change is recorded.

This module must NOT decide anything: what to do is the plan's; how it is stored is here.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.reconcile.read import LoadedState
from llmgw.engines import Profile as EngineProfile
from llmgw.engines import ShardSpec
from llmgw.planner.actions import (
    CreateReplica,
    DeleteReplica,
    DrainReplica,
    Plan,
    ReleaseShard,
    SetShardsDesiredState,
    StopReplica,
    UpdateRolloutStatus,
)
from llmgw.planner.adapter_pass import AdapterPass, action_name
from llmgw.planner.autoscale import Decision
from llmgw.planner.snapshot import DeploymentId, NodeId, ReplicaId
from llmgw.store.runtime_adapters import (
    DeclaredAdapterRow,
    write_adapter_status,
    write_desired_adapters,
)
from llmgw.store.tables import (
    Deployment,
    DeploymentAutoscale,
    DeploymentStatus,
    GpuAssignment,
    Node,
    ReconcileAction,
    Replica,
    Shard,
)

__all__ = ["ACTION_LOG_KEEP", "apply_adapters", "apply_plan", "apply_scale"]

# The action record keeps this many newest rows: enough to answer "why" for days of a busy
# fleet, bounded so a crash-looping fleet cannot grow the table without end.
ACTION_LOG_KEEP = 20_000

# The actions on a replica that exists: each is a statement or two on its own rows.
_ReplicaChange = DrainReplica | StopReplica | ReleaseShard | DeleteReplica | SetShardsDesiredState


async def apply_plan(session: AsyncSession, plan: Plan, state: LoadedState, *, epoch: int) -> None:
    """Write ``plan`` in the caller's transaction (which must have run check_epoch first)."""
    touched: set[uuid.UUID] = set()
    records: list[dict[str, Any]] = []
    replica_nodes: dict[ReplicaId, set[NodeId]] = {
        r.id: {s.node_id for s in r.shards} for r in state.snapshot.replicas
    }
    alive = await _lock_deployments(session, plan, state)
    for a in plan.actions:
        if isinstance(a, UpdateRolloutStatus):
            if a.deployment_id in alive:
                await _upsert_status(session, a)
            continue  # status changes are visible on the deployment; not an action to record
        if isinstance(a, CreateReplica):
            if a.deployment_id not in alive:
                continue  # deleted since the snapshot: the next pass drains what it left
            dep_name, profile = state.launch[a.deployment_id]
            if profile is None:
                continue  # the planner never places a broken profile; belt and braces
            await _create_replica(session, a, state, profile)
            replica_nodes[a.replica_id] = {p.node_id for p in a.shards}
            touched.update(uuid.UUID(p.node_id) for p in a.shards)
        else:
            dep_name = state.replica_deployment.get(a.replica_id, "")
            if await _change_replica(session, a):
                touched.update(uuid.UUID(n) for n in replica_nodes.get(a.replica_id, ()))
        records.append(_record(a, epoch, dep_name, replica_nodes.get(a.replica_id, ()), state))
    if touched:
        await session.execute(
            update(Node)
            .where(Node.id.in_(sorted(touched)))
            .values(desired_version=Node.desired_version + 1)
        )
    await _record_actions(session, records)


async def _record_actions(session: AsyncSession, records: list[dict[str, Any]]) -> None:
    """Insert action rows and trim the record to its newest ``ACTION_LOG_KEEP``."""
    if records:
        await session.execute(insert(ReconcileAction), records)
        await session.execute(
            text(
                "DELETE FROM reconcile_actions WHERE id <= "
                "(SELECT max(id) FROM reconcile_actions) - :keep"
            ),
            {"keep": ACTION_LOG_KEEP},
        )


def _record(
    a: CreateReplica | _ReplicaChange,
    epoch: int,
    deployment: str,
    nodes: Iterable[NodeId],
    state: LoadedState,
) -> dict[str, Any]:
    """The action's row of ``reconcile_actions``."""
    names = sorted(state.nodes[n].name for n in nodes if n in state.nodes)
    return {
        "epoch": epoch,
        "action": type(a).__name__,
        "deployment": deployment,
        "replica_id": uuid.UUID(a.replica_id),
        "node": ",".join(names)[:1000],
        "reason": a.reason[:4000],
    }


async def _lock_deployments(
    session: AsyncSession, plan: Plan, state: LoadedState
) -> set[DeploymentId]:
    """Key-share lock every deployment the plan touches, in id order, before any replica row.

    An admin deleting a deployment locks its row, then its replicas (ON DELETE SET NULL); a
    pass that locked replicas first and then needed the deployment's key (a status upsert, a
    replica insert) would deadlock with it. Taking the deployments first gives both writers
    one order. Returns the ones that still exist.
    """
    of_replica = {r.id: r.deployment_id for r in state.snapshot.replicas}
    ids: set[DeploymentId] = set()
    for a in plan.actions:
        if isinstance(a, CreateReplica | UpdateRolloutStatus):
            ids.add(a.deployment_id)
        else:
            dep = of_replica.get(a.replica_id)
            if dep is not None:
                ids.add(dep)
    if not ids:
        return set()
    rows = await session.execute(
        select(Deployment.id)
        .where(Deployment.id.in_(sorted(uuid.UUID(d) for d in ids)))
        .order_by(Deployment.id)
        .with_for_update(read=True, key_share=True)
    )
    return {DeploymentId(str(r)) for r in rows.scalars()}


async def _change_replica(session: AsyncSession, a: _ReplicaChange) -> bool:
    """The statements of one action on an existing replica; whether they changed its shards'
    desired half (then its nodes' desired_version is bumped)."""
    rid = uuid.UUID(a.replica_id)
    if isinstance(a, DrainReplica):
        # Routing drops a draining replica; its shards stay desired running until it stops.
        await session.execute(
            update(Replica)
            .where(Replica.id == rid)
            .values(state="draining", drain_deadline=a.deadline, reason=a.reason)
        )
        return False
    if isinstance(a, StopReplica):
        await session.execute(
            update(Replica).where(Replica.id == rid).values(state="stopping", reason=a.reason)
        )
        await session.execute(
            update(Shard)
            .where(Shard.replica_id == rid, Shard.released.is_(False))
            .values(desired_state="stopped")
        )
    elif isinstance(a, ReleaseShard):
        await session.execute(
            update(Shard).where(Shard.id == uuid.UUID(a.shard_id)).values(released=True)
        )
    elif isinstance(a, DeleteReplica):
        await session.execute(delete(Replica).where(Replica.id == rid))
    else:
        await session.execute(
            update(Shard)
            .where(Shard.replica_id == rid, Shard.released.is_(False))
            .values(desired_state=a.desired_state)
        )
    return True


async def _create_replica(
    session: AsyncSession, a: CreateReplica, state: LoadedState, profile: EngineProfile
) -> None:
    rid = uuid.UUID(a.replica_id)
    await session.execute(
        insert(Replica).values(
            id=rid,
            deployment_id=uuid.UUID(a.deployment_id),
            profile_fingerprint=a.profile_fingerprint,
            state="active",
            reason=a.reason[:4000],
        )
    )
    # One key per replica: every rank's engine accepts it; only the leader serves HTTP.
    api_key = secrets.token_urlsafe(32)
    shard_values = [
        {
            "id": uuid.UUID(p.shard_id),
            "replica_id": rid,
            "node_id": uuid.UUID(p.node_id),
            "rank": p.rank,
            "hcas": list(p.hcas),
            "fabric": p.fabric,
            "leader_port": p.leader_port,
            "launch_spec": _launch_spec(a, i, state, profile),
            "profile_fingerprint": a.profile_fingerprint,
            "desired_state": p.desired_state,
            "engine_api_key": api_key,
        }
        for i, p in enumerate(a.shards)
    ]
    await session.execute(insert(Shard), shard_values)
    gpu_values = list(_gpu_rows(a, state))
    if gpu_values:
        await session.execute(insert(GpuAssignment), gpu_values)


def _launch_spec(
    action: CreateReplica, rank_index: int, state: LoadedState, profile: EngineProfile
) -> dict[str, Any]:
    placement = action.shards[rank_index]
    leader = next(p for p in action.shards if p.rank == 0)
    node = state.nodes[placement.node_id]
    leader_node = state.nodes[leader.node_id]
    spec = ShardSpec(
        replica_id=action.replica_id,
        shard_id=placement.shard_id,
        rank=placement.rank,
        nnodes=len(action.shards),
        leader_addr=leader_node.mgmt_addr if len(action.shards) > 1 else "",
        leader_port=leader.leader_port or 0,
        hcas=placement.hcas,
        gid_index=node.gid_index.get(placement.fabric),
        profile=profile,
        peer_addrs=tuple(
            state.nodes[p.node_id].mgmt_addr for p in sorted(action.shards, key=lambda p: p.rank)
        )
        if len(action.shards) > 1
        else (),
        threads=placement.threads,
        pool=next((d.pool for d in state.snapshot.deployments if d.id == action.deployment_id), ""),
        fabric=placement.fabric,
        profile_fp=action.profile_fingerprint,
    )
    # The devices live in gpu_assignments (one record); the key is a column of its own.
    return spec.model_dump(
        mode="json", exclude={"gpu_indices", "gpu_uuids", "api_key", "secret_env"}
    )


def _gpu_rows(a: CreateReplica, state: LoadedState) -> Iterable[dict[str, Any]]:
    for p in a.shards:
        devices = state.nodes[p.node_id].devices
        for position, key in enumerate(p.gpu_keys):
            physical, mig = devices.get(key, (int(key) if key.isdigit() else -1, None))
            yield {
                "shard_id": uuid.UUID(p.shard_id),
                "position": position,
                "node_id": uuid.UUID(p.node_id),
                "gpu_index": physical,
                "mig_uuid": mig,
            }


async def _upsert_status(session: AsyncSession, a: UpdateRolloutStatus) -> None:
    s = a.status
    values = {
        "observed_generation": s.observed_generation,
        "replicas": s.replicas,
        "ready_replicas": s.ready_replicas,
        "updated_replicas": s.updated_replicas,
        "available_replicas": s.available_replicas,
        "unavailable_replicas": s.unavailable_replicas,
        "suspended_replicas": s.suspended_replicas,
        "stalled": s.stalled,
        "reason": s.reason[:4000],
        "progress_started_at": s.progress_started_at,
    }
    stmt = pg_insert(DeploymentStatus).values(deployment_id=uuid.UUID(a.deployment_id), **values)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=[DeploymentStatus.deployment_id],
            set_={**values, "updated_at": text("now()")},
        )
    )


async def apply_scale(
    session: AsyncSession,
    decisions: dict[DeploymentId, Decision],
    state: LoadedState,
    *,
    epoch: int,
) -> int:
    """Store the autoscaler's decisions that differ from what is stored, in the caller's
    fenced transaction (the plan that acts on them is in the same one, so a leader killed
    between the two leaves neither); record each count change in ``reconcile_actions``.
    Returns the number of count changes."""
    names = {d.id: d.name for d in state.snapshot.deployments}
    rows = []
    records = []
    for dep_id, dec in sorted(decisions.items()):
        st = state.scale.get(dep_id)
        same = (
            st is not None
            and dep_id in state.scale_stored
            and (st.desired, st.warm, st.last_scaled_at, st.idle_since, st.suspended_since)
            == (dec.desired, dec.warm, dec.last_scaled_at, dec.idle_since, dec.suspended_since)
        )
        if same and not dec.changed:
            continue
        row = {
            "deployment_id": uuid.UUID(dep_id),
            "desired_replicas": dec.desired,
            "warm_replicas": dec.warm,
            "last_scaled_at": dec.last_scaled_at,
            "idle_since": dec.idle_since,
            "suspended_since": dec.suspended_since,
        }
        if dec.changed:
            row["reason"] = dec.reason[:4000]
            records.append(
                {
                    "epoch": epoch,
                    "action": "Autoscale",
                    "deployment": names.get(dep_id, ""),
                    "replica_id": None,
                    "node": "",
                    "reason": dec.reason[:4000],
                }
            )
        rows.append(row)
    for row in rows:
        stmt = pg_insert(DeploymentAutoscale).values(**row)
        update_cols = {k: v for k, v in row.items() if k != "deployment_id"}
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=[DeploymentAutoscale.deployment_id],
                set_={**update_cols, "updated_at": text("now()")},
            )
        )
    if records:
        await session.execute(insert(ReconcileAction), records)
    return len(records)


async def apply_adapters(
    session: AsyncSession,
    placement: AdapterPass,
    declared: Iterable[DeclaredAdapterRow],
    state: LoadedState,
    *,
    epoch: int,
) -> list[uuid.UUID]:
    """Write the adapter placement in the caller's fenced transaction: rank-0 shards' new
    desired adapters (their nodes' desired_version bumped in the same statement), the
    statuses that differ from the stored ones (``declared`` as read this pass), and a
    ``reconcile_actions`` row per change. Returns the nodes whose set changed."""
    nodes = await write_desired_adapters(
        session,
        [
            (
                uuid.UUID(w.shard_id),
                [{"name": a.name, "path": a.path, "pinned": a.pinned} for a in w.adapters],
            )
            for w in placement.writes
        ],
    )
    stored = {a.name: (a.desired_replicas, a.unplaced) for a in declared}
    await write_adapter_status(
        session,
        [
            (name, st.desired_replicas, st.unplaced)
            for name, st in placement.status.items()
            if stored.get(name) != (st.desired_replicas, st.unplaced)
        ],
    )
    leader_node = {
        r.id: s.node_id for r in state.snapshot.replicas for s in r.shards if s.rank == 0
    }
    records = []
    for c in placement.changes:
        rid = c.replica_id
        node = state.nodes.get(leader_node[rid]) if rid in leader_node else None
        records.append(
            {
                "epoch": epoch,
                "action": action_name(c),
                "deployment": "" if rid is None else state.replica_deployment.get(rid, ""),
                "replica_id": None if rid is None else uuid.UUID(rid),
                "node": "" if node is None else node.name,
                "reason": c.reason[:4000],
            }
        )
    await _record_actions(session, records)
    return nodes
