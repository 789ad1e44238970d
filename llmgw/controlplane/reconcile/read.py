"""The reconcile pass's read: desired and observed state in five statements, as frozen views.

A constant number of statements, whatever the fleet's size: deployments (with their
profiles, models and rollout status), nodes (with their status), replicas, shards (with the
GPUs they hold) and GPU classes. Rows become the views of ``planner/snapshot.py``; what
writing the plan needs and the planner must not see (node names and addresses, the devices
behind placement's GPU keys, the engines' profiles) rides beside the snapshot in
``LoadedState``.

This module must NOT decide anything: where reading a row takes a rule (which reported GPUs
are placeable, what counts as evidence of life, what a profile the engines refuse asks for
and keeps, how stored GPU classes join the configured ones), the rule is the planner's
(``planner/intake.py``); here rows are only read and turned into views.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import Text, cast, func, select
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from llmgw.controlplane.profile_checks import SPEC_FIELDS, engine_profile
from llmgw.controlplane.reconcile.inventories import InventoryMemo, Placeable
from llmgw.engines import Profile as EngineProfile
from llmgw.planner import intake
from llmgw.planner.adapter_pass import Holder, Served, parse_desired, parse_observed
from llmgw.planner.autoscale import AutoscalePolicy, ScaleState
from llmgw.planner.intake import Device
from llmgw.planner.snapshot import (
    DeploymentId,
    DeploymentView,
    NodeId,
    NodeView,
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
    # Every deployment's model and profile as the adapter placement reads them.
    adapter_served: Mapping[DeploymentId, Served] = field(default_factory=dict)
    # Rank-0 shards not released -> what they hold of runtime adapters and may.
    adapter_holders: Mapping[ShardId, Holder] = field(default_factory=dict)


async def load_snapshot(
    session: AsyncSession,
    *,
    settings: PlanSettings,
    now: datetime,
    observing_since: datetime | None = None,
) -> LoadedState:
    """Desired and observed state in five statements, as frozen views.

    ``observing_since``: when the caller began watching the fleet without a gap; nodes are
    judged silent only from then (``intake.evidence_of_life``).
    """
    deployments = await _deployments(session)
    nodes = await _nodes(session, observing_since)
    replica_rows = await _replica_rows(session)
    holders: dict[ShardId, Holder] = {}
    shards_of = await _shards(session, nodes.facts, holders)
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
        adapter_served=deployments.adapter_served,
        adapter_holders=holders,
    )


# --- deployments ------------------------------------------------------------------------

# Rows as rows, not ORM objects, in every statement of the pass: building an instance per row
# (a deployment and its status here, ~8 per node in the tables that grow with the fleet) made
# a large fleet's pass spend most of its time in the ORM (bench/reconcile.py). Ids are read as
# text: they only ever become the views' strings and dict keys, and a uuid.UUID per id, turned
# back into a str, was itself a measurable part of a 10,000-node load.

_PROFILE_FIELDS = ("name", "fingerprint", *SPEC_FIELDS)
# RolloutStatus's fields are deployment_status's columns, name for name.
_STATUS_FIELDS = tuple(RolloutStatus.__dataclass_fields__)
_SCALE_FIELDS = (
    "desired_replicas", "warm_replicas", "last_scaled_at", "idle_since", "suspended_since",
)  # fmt: skip


def _text_id(column: Any) -> ColumnElement[str]:
    return cast(column, Text)


@dataclass(frozen=True, slots=True)
class _Deployments:
    views: list[DeploymentView] = field(default_factory=list)
    launch: dict[DeploymentId, tuple[str, EngineProfile | None]] = field(default_factory=dict)
    unlaunchable: dict[DeploymentId, str] = field(default_factory=dict)
    served: dict[DeploymentId, str] = field(default_factory=dict)
    scale: dict[DeploymentId, ScaleState] = field(default_factory=dict)
    stored: set[DeploymentId] = field(default_factory=set)
    adapter_served: dict[DeploymentId, Served] = field(default_factory=dict)


async def _deployments(session: AsyncSession) -> _Deployments:
    rows = (
        await session.execute(
            select(
                _text_id(Deployment.id).label("id"),
                Deployment.name,
                Deployment.replicas,
                Deployment.pool,
                Deployment.max_surge,
                Deployment.max_unavailable,
                Deployment.progress_deadline_s,
                Deployment.state,
                Deployment.generation,
                Deployment.autoscale,
                _text_id(Profile.id).label("profile_id"),
                *(getattr(Profile, f).label(f"profile_{f}") for f in _PROFILE_FIELDS),
                Model.name.label("model_name"),
                DeploymentStatus.deployment_id.is_not(None).label("has_status"),
                *(getattr(DeploymentStatus, f).label(f"status_{f}") for f in _STATUS_FIELDS),
                DeploymentAutoscale.deployment_id.is_not(None).label("has_scale"),
                *(getattr(DeploymentAutoscale, f) for f in _SCALE_FIELDS),
            )
            .join(Profile, Profile.id == Deployment.profile_id)
            .join(Model, Model.id == Deployment.model_id)
            .outerjoin(DeploymentStatus, DeploymentStatus.deployment_id == Deployment.id)
            .outerjoin(DeploymentAutoscale, DeploymentAutoscale.deployment_id == Deployment.id)
            .order_by(Deployment.name)
        )
    ).all()
    out = _Deployments()
    # Deployments share profiles: the engines' Profile (a validated model) and what placement
    # needs of it are built once per (profile, model), not once per deployment.
    launches: dict[tuple[str, str], intake.Launch] = {}
    for row in rows:
        dep_id = DeploymentId(row.id)
        key = (row.profile_id, row.model_name)
        launch = launches.get(key)
        if launch is None:
            launch = launches[key] = intake.launch_of(
                row.profile_name,
                row.profile_gpu_class,
                partial(_engine_profile, row, row.model_name),
            )
        if launch.refusal:
            out.unlaunchable[dep_id] = launch.refusal
        view = _deployment_view(dep_id, row, launch)
        if row.autoscale is not None:
            scale = _scale_state(row)
            view = replace(
                view,
                autoscale=_policy(row.autoscale),
                replicas=scale.desired,
                warm_replicas=scale.warm,
            )
            out.scale[dep_id] = scale
            if row.has_scale:
                out.stored.add(dep_id)
            out.served[dep_id] = row.profile_served_model_name or row.model_name
        out.views.append(view)
        out.launch[dep_id] = (row.name, launch.profile)
        out.adapter_served[dep_id] = Served(
            model=row.model_name,
            profile=row.profile_name,
            adapter_slots=0 if launch.profile is None else launch.profile.adapter_slots,
        )
    return out


def _policy(doc: Mapping[str, Any]) -> AutoscalePolicy:
    """The stored mapping (validated by schemas.AutoscaleBody on the way in) as the decider's
    policy; keys a later release added and this one does not know are ignored."""
    known = set(AutoscalePolicy.__dataclass_fields__)
    return AutoscalePolicy(**{k: v for k, v in doc.items() if k in known})


def _scale_state(row: Any) -> ScaleState:
    if not row.has_scale:  # no decision yet: the operator's replicas are where it starts
        return ScaleState(desired=row.replicas, warm=row.replicas)
    return ScaleState(
        desired=row.desired_replicas,
        warm=row.warm_replicas,
        last_scaled_at=row.last_scaled_at,
        idle_since=row.idle_since,
        suspended_since=row.suspended_since,
    )


def _engine_profile(row: Any, model_name: str) -> EngineProfile:
    fields = {name: getattr(row, f"profile_{name}") for name in SPEC_FIELDS}
    return engine_profile(row.profile_name, fields, model=model_name)


def _deployment_view(dep_id: DeploymentId, row: Any, launch: intake.Launch) -> DeploymentView:
    return DeploymentView(
        id=dep_id,
        name=row.name,
        profile=ProfileView(
            name=row.profile_name,
            engine=row.profile_engine,
            fingerprint=row.profile_fingerprint,
            requirements=launch.requirements,
            suspend_refusal=launch.suspend_refusal,
        ),
        replicas=row.replicas,
        pool=row.pool,
        max_surge=row.max_surge,
        max_unavailable=row.max_unavailable,
        progress_deadline_s=row.progress_deadline_s,
        suspended=row.state == "suspended",
        generation=row.generation,
        status=_rollout_status(row) if row.has_status else RolloutStatus(),
    )


def _rollout_status(row: Any) -> RolloutStatus:
    return RolloutStatus(**{f: getattr(row, f"status_{f}") for f in _STATUS_FIELDS})


# --- nodes ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Nodes:
    views: list[NodeView] = field(default_factory=list)
    facts: dict[NodeId, NodeFacts] = field(default_factory=dict)


# One per process (InventoryMemo says why that is right).
_INVENTORIES = InventoryMemo()
# A node whose agent never reported: no status row, nothing placeable.
_UNREPORTED = Placeable.of({})


async def _nodes(session: AsyncSession, observing_since: datetime | None) -> _Nodes:
    rows = (
        await session.execute(
            select(
                _text_id(Node.id).label("id"),
                Node.name,
                Node.pool,
                Node.approval_state,
                Node.cordoned,
                Node.draining,
                NodeStatus.node_id.is_not(None).label("reported"),
                # As text, parsed only where the memo has not seen it (inventories.py).
                cast(NodeStatus.inventory, Text).label("inventory"),
                NodeStatus.last_sync_at,
                NodeStatus.mgmt_addr,
            ).outerjoin(NodeStatus, NodeStatus.node_id == Node.id)
        )
    ).all()
    out = _Nodes()
    for row in rows:
        node_id = NodeId(row.id)
        # A node whose agent never reported has no status row: no inventory, no sync, no address.
        reported = row.reported
        placeable = _INVENTORIES.placeable(row.inventory) if reported else _UNREPORTED
        inventory = placeable.inventory
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
            placement_index=placeable.placement_index,
            gid_index=inventory.gid_index,
        )
    _INVENTORIES.end_pass()
    return out


# --- replicas, shards and their GPUs ----------------------------------------------------


async def _replica_rows(session: AsyncSession) -> Sequence[Any]:
    return (
        await session.execute(
            select(
                _text_id(Replica.id).label("id"),
                _text_id(Replica.deployment_id).label("deployment_id"),
                Replica.profile_fingerprint,
                Replica.created_at,
                Replica.state,
                Replica.drain_deadline,
                Replica.reason,
            )
        )
    ).all()


async def _shards(
    session: AsyncSession, facts: Mapping[NodeId, NodeFacts], holders: dict[ShardId, Holder]
) -> dict[str, list[ShardView]]:
    """Every shard as a view, by replica id, in rank order: one statement, the GPUs each
    holds aggregated beside it in order of position (not a row per GPU, ~7 per shard).
    Only the columns the view needs: the launch spec is the complete ShardSpec, of which
    the planner reads one number, and the adapter placement another (the slots its engine
    was launched with). Live rank-0 shards' runtime adapters go into ``holders``, read as
    text: nearly all are '[]', which is not worth a JSON parse per shard per pass."""
    gpus = (
        select(
            GpuAssignment.shard_id,
            func.array_agg(
                aggregate_order_by(GpuAssignment.gpu_index, GpuAssignment.position)
            ).label("indices"),
            func.array_agg(
                aggregate_order_by(GpuAssignment.mig_uuid, GpuAssignment.position)
            ).label("migs"),
        )
        .where(GpuAssignment.shard_released.is_(False))
        .group_by(GpuAssignment.shard_id)
        .subquery()
    )
    rows = (
        await session.execute(
            select(
                _text_id(Shard.id).label("id"),
                _text_id(Shard.replica_id).label("replica_id"),
                _text_id(Shard.node_id).label("node_id"),
                Shard.rank,
                Shard.hcas,
                Shard.fabric,
                Shard.leader_port,
                Shard.launch_spec["threads"].label("threads"),
                Shard.launch_spec["profile"]["adapter_slots"].label("adapter_slots"),
                cast(Shard.desired_adapters, Text).label("desired_adapters"),
                cast(Shard.observed_adapters, Text).label("observed_adapters"),
                Shard.desired_state,
                Shard.released,
                Shard.observed_state,
                Shard.observed_reason,
                Shard.restarts,
                gpus.c.indices,
                gpus.c.migs,
            )
            .outerjoin(gpus, gpus.c.shard_id == Shard.id)
            .order_by(Shard.rank)
        )
    ).all()
    shards_of: dict[str, list[ShardView]] = {}
    for s in rows:
        node_id = NodeId(s.node_id)
        placement_index = facts[node_id].placement_index if node_id in facts else {}
        shards_of.setdefault(s.replica_id, []).append(_shard_view(s, node_id, placement_index))
        if s.rank == 0 and not s.released:
            holders[ShardId(s.id)] = Holder(
                slots=s.adapter_slots if isinstance(s.adapter_slots, int) else 0,
                desired=parse_desired(s.desired_adapters),
                observed=parse_observed(s.observed_adapters),
            )
    return shards_of


def _shard_view(s: Any, node_id: NodeId, placement_index: Mapping[Device, int]) -> ShardView:
    # A shard holding no live GPU (released, or CPU-only) has no aggregate row: NULL arrays.
    held: list[Device] = list(zip(s.indices, s.migs, strict=True)) if s.indices else []
    return ShardView(
        id=ShardId(s.id),
        replica_id=ReplicaId(s.replica_id),
        node_id=node_id,
        rank=s.rank,
        gpu_indices=tuple(placement_index.get(d, d[0]) for d in held),
        # The key gpu_assignments rows are written under (GPU.key): "3", or the MIG uuid.
        gpu_keys=tuple(mig or str(index) for index, mig in held),
        hcas=tuple(s.hcas),
        fabric=s.fabric,
        leader_port=s.leader_port,
        threads=int(s.threads or 0),
        desired_state=s.desired_state,
        released=s.released,
        observed_state=s.observed_state,
        observed_reason=s.observed_reason,
        restarts=s.restarts,
    )


def _replica_view(r: Any, shards: Sequence[ShardView]) -> ReplicaView:
    return ReplicaView(
        id=ReplicaId(r.id),
        deployment_id=DeploymentId(r.deployment_id) if r.deployment_id else None,
        profile_fingerprint=r.profile_fingerprint,
        created_at=r.created_at,
        shards=tuple(shards),
        state=r.state,
        drain_deadline=r.drain_deadline,
        reason=r.reason,
    )


async def _gpu_classes(session: AsyncSession) -> tuple[tuple[str, str], ...]:
    """The GPU classes admins stored, as (name, pattern) in name order."""
    rows = (
        await session.execute(select(GpuClass.name, GpuClass.pattern).order_by(GpuClass.name))
    ).all()
    return tuple((c.name, c.pattern) for c in rows)
