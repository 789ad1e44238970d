"""The reconcile pass's read: desired and observed state in six statements, as frozen views.

One statement per table, whatever the fleet's size: deployments (with their profiles, models
and rollout status), nodes (with their status), replicas, shards, GPU assignments and GPU
classes. Rows become the views of ``planner/snapshot.py``; what writing the plan needs and
the planner must not see (node names and addresses, the devices behind placement's GPU keys,
the engines' profiles) rides beside the snapshot in ``LoadedState``.

This module must NOT decide anything: where reading a row takes a rule (which reported GPUs
are placeable, what counts as evidence of life, what a profile the engines refuse asks for
and keeps, how stored GPU classes join the configured ones), the rule is the planner's
(``planner/intake.py``); here rows are only read and turned into views.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.profile_checks import SPEC_FIELDS, engine_profile
from llmgw.engines import Profile as EngineProfile
from llmgw.planner import intake
from llmgw.planner.autoscale import AutoscalePolicy, ScaleState
from llmgw.planner.intake import Device
from llmgw.planner.snapshot import (
    DeploymentId,
    DeploymentView,
    NodeId,
    NodeView,
    PlacementRequirements,
    PlanSettings,
    ProfileView,
    ReplicaId,
    ReplicaView,
    RolloutStatus,
    ShardId,
    ShardView,
    Snapshot,
)
from llmgw.store.tables import (
    Deployment,
    DeploymentAutoscale,
    DeploymentStatus,
    GpuAssignment,
    GpuClass,
    Model,
    Node,
    NodeStatus,
    Profile,
    Replica,
    Shard,
)

__all__ = ["LoadedState", "NodeFacts", "load_snapshot"]


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What the writer needs of a node beyond the planner's view."""

    name: str
    mgmt_addr: str
    # Placement's GPU key ("3", "MIG-<uuid>") -> (physical GPU index, MIG uuid or None).
    devices: Mapping[str, Device]
    # (physical GPU index, MIG uuid or None) -> the index placement knows the device by.
    placement_index: Mapping[Device, int]
    gid_index: Mapping[str, int | None]


@dataclass(frozen=True, slots=True)
class LoadedState:
    """A snapshot plus what writing its plan needs and the planner must not see."""

    snapshot: Snapshot
    nodes: Mapping[NodeId, NodeFacts]
    # Deployment id -> (name, the engines' Profile its replicas launch from).
    launch: Mapping[DeploymentId, tuple[str, EngineProfile | None]]
    # Deployments whose profile cannot be launched -> why, for their status.
    broken: Mapping[DeploymentId, str] = field(default_factory=dict)
    replica_deployment: Mapping[ReplicaId, str] = field(default_factory=dict)
    # Autoscaled deployments -> the model name clients send (what gateway_demand is keyed by).
    served: Mapping[DeploymentId, str] = field(default_factory=dict)
    # Autoscaled deployments -> the leader's last decision as stored (or where it starts).
    scale: Mapping[DeploymentId, ScaleState] = field(default_factory=dict)
    # Those of them whose decision row exists (the others get one on the next pass).
    scale_stored: frozenset[DeploymentId] = frozenset()


async def load_snapshot(
    session: AsyncSession,
    *,
    settings: PlanSettings,
    now: datetime,
    observing_since: datetime | None = None,
) -> LoadedState:
    """Desired and observed state in six statements, as frozen views.

    ``observing_since``: when the caller began watching the fleet without a gap; nodes are
    judged silent only from then (``intake.evidence_of_life``).
    """
    deployments = await _deployments(session)
    nodes = await _nodes(session, observing_since)
    replica_rows = await _replica_rows(session)
    shards_of = await _shards(session, nodes.facts)
    gpu_classes = await _gpu_classes(session)
    replicas = tuple(_replica_view(r, shards_of.get(r.id, ())) for r in replica_rows)
    snapshot = Snapshot(
        deployments=intake.freeze_unlaunchable(
            deployments.views, replicas, deployments.unlaunchable
        ),
        nodes=tuple(nodes.views),
        replicas=replicas,
        settings=intake.with_gpu_classes(settings, gpu_classes),
    )
    names = {d.id: d.name for d in snapshot.deployments}
    return LoadedState(
        snapshot=snapshot,
        nodes=nodes.facts,
        launch=deployments.launch,
        broken=deployments.unlaunchable,
        replica_deployment={
            r.id: names.get(r.deployment_id, "") if r.deployment_id else "" for r in replicas
        },
        served=deployments.served,
        scale=deployments.scale,
        scale_stored=frozenset(deployments.stored),
    )


# --- deployments ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Deployments:
    views: list[DeploymentView] = field(default_factory=list)
    launch: dict[DeploymentId, tuple[str, EngineProfile | None]] = field(default_factory=dict)
    unlaunchable: dict[DeploymentId, str] = field(default_factory=dict)
    served: dict[DeploymentId, str] = field(default_factory=dict)
    scale: dict[DeploymentId, ScaleState] = field(default_factory=dict)
    stored: set[DeploymentId] = field(default_factory=set)


async def _deployments(session: AsyncSession) -> _Deployments:
    rows = (
        await session.execute(
            select(Deployment, Profile, Model.name, DeploymentStatus, DeploymentAutoscale)
            .join(Profile, Profile.id == Deployment.profile_id)
            .join(Model, Model.id == Deployment.model_id)
            .outerjoin(DeploymentStatus, DeploymentStatus.deployment_id == Deployment.id)
            .outerjoin(DeploymentAutoscale, DeploymentAutoscale.deployment_id == Deployment.id)
            .order_by(Deployment.name)
        )
    ).all()
    out = _Deployments()
    for dep, prof, model_name, status, scaled in rows:
        dep_id = DeploymentId(str(dep.id))
        launch = intake.launch_of(
            prof.name, prof.gpu_class, partial(_engine_profile, prof, model_name)
        )
        if launch.refusal:
            out.unlaunchable[dep_id] = launch.refusal
        view = _deployment_view(dep_id, dep, prof, launch.requirements, status)
        if dep.autoscale is not None:
            scale = _scale_state(dep, scaled)
            view = replace(
                view,
                autoscale=_policy(dep.autoscale),
                replicas=scale.desired,
                warm_replicas=scale.warm,
            )
            out.scale[dep_id] = scale
            if scaled is not None:
                out.stored.add(dep_id)
            out.served[dep_id] = prof.served_model_name or model_name
        out.views.append(view)
        out.launch[dep_id] = (dep.name, launch.profile)
    return out


def _policy(doc: Mapping[str, Any]) -> AutoscalePolicy:
    """The stored mapping (validated by schemas.AutoscaleBody on the way in) as the decider's
    policy; keys a later release added and this one does not know are ignored."""
    known = set(AutoscalePolicy.__dataclass_fields__)
    return AutoscalePolicy(**{k: v for k, v in doc.items() if k in known})


def _scale_state(dep: Deployment, row: DeploymentAutoscale | None) -> ScaleState:
    if row is None:  # no decision yet: the operator's replicas are where it starts
        return ScaleState(desired=dep.replicas, warm=dep.replicas)
    return ScaleState(
        desired=row.desired_replicas,
        warm=row.warm_replicas,
        last_scaled_at=row.last_scaled_at,
        idle_since=row.idle_since,
        suspended_since=row.suspended_since,
    )


def _engine_profile(p: Profile, model_name: str) -> EngineProfile:
    fields = {name: getattr(p, name) for name in SPEC_FIELDS}
    return engine_profile(p.name, fields, model=model_name)


def _deployment_view(
    dep_id: DeploymentId,
    dep: Deployment,
    prof: Profile,
    requirements: PlacementRequirements,
    status: DeploymentStatus | None,
) -> DeploymentView:
    return DeploymentView(
        id=dep_id,
        name=dep.name,
        profile=ProfileView(
            name=prof.name,
            engine=prof.engine,
            fingerprint=prof.fingerprint,
            requirements=requirements,
        ),
        replicas=dep.replicas,
        pool=dep.pool,
        max_surge=dep.max_surge,
        max_unavailable=dep.max_unavailable,
        progress_deadline_s=dep.progress_deadline_s,
        suspended=dep.state == "suspended",
        generation=dep.generation,
        status=RolloutStatus() if status is None else _rollout_status(status),
    )


def _rollout_status(st: DeploymentStatus) -> RolloutStatus:
    return RolloutStatus(
        observed_generation=st.observed_generation,
        replicas=st.replicas,
        ready_replicas=st.ready_replicas,
        updated_replicas=st.updated_replicas,
        available_replicas=st.available_replicas,
        unavailable_replicas=st.unavailable_replicas,
        suspended_replicas=st.suspended_replicas,
        stalled=st.stalled,
        reason=st.reason,
        progress_started_at=st.progress_started_at,
    )


# --- nodes ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Nodes:
    views: list[NodeView] = field(default_factory=list)
    facts: dict[NodeId, NodeFacts] = field(default_factory=dict)


async def _nodes(session: AsyncSession, observing_since: datetime | None) -> _Nodes:
    # Plain rows, not ORM objects, for the tables that grow with the fleet (nodes, replicas,
    # shards, GPU assignments): building ~8 ORM instances per node made a 1,000-node pass
    # spend most of its time in the ORM and the cyclic GC (bench/reconcile.py).
    rows = (
        await session.execute(
            select(
                Node.id,
                Node.name,
                Node.pool,
                Node.approval_state,
                Node.cordoned,
                Node.draining,
                NodeStatus.node_id.label("status_of"),
                NodeStatus.inventory,
                NodeStatus.last_sync_at,
                NodeStatus.mgmt_addr,
            ).outerjoin(NodeStatus, NodeStatus.node_id == Node.id)
        )
    ).all()
    out = _Nodes()
    for row in rows:
        node_id = NodeId(str(row.id))
        # A node whose agent never reported has no status row: no inventory, no sync, no address.
        reported = row.status_of is not None
        inventory = intake.placeable(row.inventory if reported else {})
        out.views.append(
            NodeView(
                id=node_id,
                name=row.name,
                pool=row.pool,
                approved=row.approval_state == "approved",
                cordoned=row.cordoned,
                draining=row.draining,
                last_sync_at=intake.evidence_of_life(
                    row.last_sync_at if reported else None, observing_since
                ),
                gpus=inventory.gpus,
                fabrics=inventory.fabrics,
                cpu_threads=inventory.cpu_threads,
            )
        )
        out.facts[node_id] = NodeFacts(
            name=row.name,
            mgmt_addr=row.mgmt_addr if reported else "",
            devices=inventory.devices,
            placement_index=inventory.placement_index(),
            gid_index=inventory.gid_index,
        )
    return out


# --- replicas, shards and their GPUs ----------------------------------------------------


async def _replica_rows(session: AsyncSession) -> Sequence[Any]:
    return (await session.execute(select(*Replica.__table__.c))).all()


async def _shards(
    session: AsyncSession, facts: Mapping[NodeId, NodeFacts]
) -> dict[uuid.UUID, list[ShardView]]:
    """Every shard as a view, by replica id, in rank order: two statements (the shards, the
    GPUs they hold)."""
    shard_rows = (await session.execute(select(*Shard.__table__.c).order_by(Shard.rank))).all()
    gpu_rows = (
        await session.execute(
            select(GpuAssignment.shard_id, GpuAssignment.gpu_index, GpuAssignment.mig_uuid)
            .where(GpuAssignment.shard_released.is_(False))
            .order_by(GpuAssignment.shard_id, GpuAssignment.position)
        )
    ).all()
    held: dict[uuid.UUID, list[Any]] = {}
    for g in gpu_rows:
        held.setdefault(g.shard_id, []).append(g)
    shards_of: dict[uuid.UUID, list[ShardView]] = {}
    for s in shard_rows:
        node_id = NodeId(str(s.node_id))
        placement_index = facts[node_id].placement_index if node_id in facts else {}
        shards_of.setdefault(s.replica_id, []).append(
            _shard_view(s, node_id, held.get(s.id, []), placement_index)
        )
    return shards_of


def _shard_view(
    s: Any, node_id: NodeId, held: list[Any], placement_index: Mapping[Device, int]
) -> ShardView:
    return ShardView(
        id=ShardId(str(s.id)),
        replica_id=ReplicaId(str(s.replica_id)),
        node_id=node_id,
        rank=s.rank,
        gpu_indices=tuple(
            placement_index.get((g.gpu_index, g.mig_uuid), g.gpu_index) for g in held
        ),
        # The key gpu_assignments rows are written under (GPU.key): "3", or the MIG uuid.
        gpu_keys=tuple(g.mig_uuid or str(g.gpu_index) for g in held),
        hcas=tuple(s.hcas),
        fabric=s.fabric,
        leader_port=s.leader_port,
        threads=int(s.launch_spec.get("threads") or 0),
        desired_state=s.desired_state,
        released=s.released,
        observed_state=s.observed_state,
        observed_reason=s.observed_reason,
        restarts=s.restarts,
    )


def _replica_view(r: Any, shards: Sequence[ShardView]) -> ReplicaView:
    return ReplicaView(
        id=ReplicaId(str(r.id)),
        deployment_id=DeploymentId(str(r.deployment_id)) if r.deployment_id else None,
        profile_fingerprint=r.profile_fingerprint,
        created_at=r.created_at,
        shards=tuple(shards),
        state=r.state,
        drain_deadline=r.drain_deadline,
        reason=r.reason,
    )


async def _gpu_classes(session: AsyncSession) -> tuple[tuple[str, str], ...]:
    """The GPU classes admins stored, as (name, pattern) in name order."""
    rows = (await session.execute(select(GpuClass).order_by(GpuClass.name))).scalars()
    return tuple((c.name, c.pattern) for c in rows)
