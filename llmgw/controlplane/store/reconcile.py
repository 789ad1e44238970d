"""The reconciler's SQL: read a consistent snapshot in a constant number of queries, and
write a plan's actions in the caller's transaction.

Reading: six statements whatever the fleet's size (deployments with their profiles,
nodes with their status, replicas, shards, GPU assignments, GPU classes); rows become
the frozen views of ``snapshot.py`` before the pure planner sees them.

Writing: ``apply_plan`` runs inside the transaction that ``check_epoch`` opened, so a
leader that lost its lock writes nothing. Every node whose desired shards change gets
its ``desired_version`` bumped in the same transaction: that is the ETag agents sync
on, and a change without a bump would never reach the node. Launch specs are built
here from the stored profile, the placement and the nodes' reported addresses; the
GPUs themselves are written only as ``gpu_assignments`` rows (the one record of who
holds which GPU), and the agent API adds them to the spec it serves.

This module must NOT decide anything: what to do is the plan's; how it is stored is here.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.planner.actions import (
    CreateReplica,
    DeleteReplica,
    DrainReplica,
    Plan,
    ReleaseShard,
    SetShardsDesiredState,
    StopReplica,
    UpdateRolloutStatus,
)
from llmgw.controlplane.planner.snapshot import (
    GPU,
    SIM_GPU_CLASS,
    DeploymentId,
    DeploymentView,
    Fabric,
    FabricName,
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
from llmgw.controlplane.profile_checks import LAUNCH_FIELDS, engine_profile
from llmgw.controlplane.store.tables import (
    Deployment,
    DeploymentStatus,
    GpuAssignment,
    GpuClass,
    Model,
    Node,
    NodeStatus,
    Profile,
    ReconcileAction,
    Replica,
    Shard,
)
from llmgw.engines import Profile as EngineProfile
from llmgw.engines import ShardSpec, placement_requirements
from llmgw.errors import LlmgwError

__all__ = ["ACTION_LOG_KEEP", "LoadedState", "apply_plan", "load_snapshot"]

# The action record keeps this many newest rows: enough to answer "why" for days of a busy
# fleet, bounded so a crash-looping fleet cannot grow the table without end.
ACTION_LOG_KEEP = 20_000


@dataclass(frozen=True, slots=True)
class _NodeFacts:
    """What the writer needs of a node beyond the planner's view."""

    name: str
    mgmt_addr: str
    # Placement's GPU key ("3", "MIG-<uuid>") -> (physical GPU index, MIG uuid or None).
    devices: Mapping[str, tuple[int, str | None]]
    # (physical GPU index, MIG uuid or None) -> the index placement knows the device by
    # (MIG instances are numbered from 1000 up; CUDA gives them none).
    placement_index: Mapping[tuple[int, str | None], int]
    gid_index: Mapping[str, int | None]


@dataclass(frozen=True, slots=True)
class LoadedState:
    """A snapshot plus what writing its plan needs and the planner must not see."""

    snapshot: Snapshot
    nodes: Mapping[NodeId, _NodeFacts]
    # Deployment id -> (name, the engines' Profile its replicas launch from).
    launch: Mapping[DeploymentId, tuple[str, EngineProfile | None]]
    # Profiles the engines package refuses (a newer llmgw's rule, a hand-edited row): named
    # in the deployment's status instead of failing the whole pass.
    broken: Mapping[DeploymentId, str] = field(default_factory=dict)
    replica_deployment: Mapping[ReplicaId, str] = field(default_factory=dict)


def _gpus(
    inventory: Mapping[str, Any],
) -> tuple[tuple[GPU, ...], dict[str, tuple[int, str | None]]]:
    """The placeable GPUs of an agent's inventory (llmgw.protocol.NodeInventory as JSON)."""
    devices = [d for d in inventory.get("gpus") or [] if isinstance(d, dict)]
    index_of_uuid = {d.get("uuid"): d.get("index") for d in devices if d.get("uuid")}
    gpus: list[GPU] = []
    keys: dict[str, tuple[int, str | None]] = {}
    for d in devices:
        if d.get("mig_enabled"):
            continue  # carved into instances: only those are placeable
        parent_uuid = d.get("mig_parent_uuid") or ""
        parent = index_of_uuid.get(parent_uuid) if parent_uuid else None
        if parent_uuid and parent is None:
            continue  # an instance of a GPU the agent did not list: nothing safe to key it on
        # Simulated GPUs go by the class they resolve to, so no pattern can match a real class.
        name = SIM_GPU_CLASS if d.get("simulated") else str(d.get("name") or "")
        gpu = GPU(
            index=int(d["index"]), name=name, uuid=str(d.get("uuid") or ""), mig_parent=parent
        )
        gpus.append(gpu)
        keys[gpu.key] = (int(parent), gpu.key) if parent is not None else (gpu.index, None)
    return tuple(gpus), keys


def _fabrics(inventory: Mapping[str, Any]) -> tuple[tuple[Fabric, ...], dict[str, int | None]]:
    fabrics: list[Fabric] = []
    gid: dict[str, int | None] = {}
    for f in inventory.get("fabrics") or []:
        if not isinstance(f, dict) or not f.get("present", True):
            continue  # an HCA the config names is missing: never place a multi-node replica on it
        fabrics.append(Fabric(name=FabricName(str(f["name"])), hcas=tuple(f.get("hcas") or ())))
        gid[str(f["name"])] = f.get("gid_index")
    return tuple(fabrics), gid


def _evidence_of_life(last_sync_at: datetime | None, since: datetime | None) -> datetime | None:
    # A node that never synced stays unknown: it has earned no grace.
    if last_sync_at is None or since is None:
        return last_sync_at
    return max(last_sync_at, since)


def _requirements(profile: EngineProfile) -> PlacementRequirements:
    return placement_requirements(profile)


def _engine_profile(p: Profile, model_name: str) -> EngineProfile:
    fields = {name: getattr(p, name) for name in LAUNCH_FIELDS}
    return engine_profile(p.name, fields, model=model_name)


async def load_snapshot(
    session: AsyncSession,
    *,
    settings: PlanSettings,
    now: datetime,
    observing_since: datetime | None = None,
) -> LoadedState:
    """Desired and observed state in six statements, as frozen views.

    ``observing_since``: when the caller began watching the fleet without a gap (it took
    the lead, or its passes work again after a failure). A node is judged silent only by
    what happened since then: after an outage of the control planes or Postgres, every
    node's last sync is old through no fault of its own, and a leader that counted that
    silence would replace every replica of the fleet before a single agent could sync.
    """
    rows = (
        await session.execute(
            select(Deployment, Profile, Model.name, DeploymentStatus)
            .join(Profile, Profile.id == Deployment.profile_id)
            .join(Model, Model.id == Deployment.model_id)
            .outerjoin(DeploymentStatus, DeploymentStatus.deployment_id == Deployment.id)
            .order_by(Deployment.name)
        )
    ).all()
    deployments: list[DeploymentView] = []
    launch: dict[DeploymentId, tuple[str, EngineProfile | None]] = {}
    broken: dict[DeploymentId, str] = {}
    for dep, prof, model_name, st in rows:
        dep_id = DeploymentId(str(dep.id))
        try:
            eprof: EngineProfile | None = _engine_profile(prof, model_name)
            assert eprof is not None
            req = _requirements(eprof)
        except (LlmgwError, ValueError) as exc:
            # One bad profile must not stop the fleet's reconcile: it gets no new replicas.
            eprof = None
            req = PlacementRequirements(
                gpu_class=prof.gpu_class,
                nodes=1,
                gpus_per_node=1,
                threads=0,
                cpu_only=False,
                mig_allowed=False,
                same_gpu_indices_across_nodes=False,
                same_hcas_across_nodes=False,
            )
            broken[dep_id] = f"profile {prof.name!r} cannot be launched: {exc}"
        status = (
            RolloutStatus(
                observed_generation=st.observed_generation,
                replicas=st.replicas,
                ready_replicas=st.ready_replicas,
                updated_replicas=st.updated_replicas,
                available_replicas=st.available_replicas,
                unavailable_replicas=st.unavailable_replicas,
                stalled=st.stalled,
                reason=st.reason,
                progress_started_at=st.progress_started_at,
            )
            if st is not None
            else RolloutStatus()
        )
        deployments.append(
            DeploymentView(
                id=dep_id,
                name=dep.name,
                profile=ProfileView(
                    name=prof.name,
                    engine=prof.engine,
                    fingerprint=prof.fingerprint,
                    requirements=req,
                ),
                replicas=dep.replicas,
                pool=dep.pool,
                max_surge=dep.max_surge,
                max_unavailable=dep.max_unavailable,
                progress_deadline_s=dep.progress_deadline_s,
                suspended=dep.state == "suspended",
                generation=dep.generation,
                status=status,
            )
        )
        launch[dep_id] = (dep.name, eprof)

    # Plain rows, not ORM objects, for the tables that grow with the fleet (nodes, replicas,
    # shards, GPU assignments): building ~8 ORM instances per node made a 1,000-node pass
    # spend most of its time in the ORM and the cyclic GC (bench/reconcile.py).
    node_rows = (
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
    nodes: list[NodeView] = []
    facts: dict[NodeId, _NodeFacts] = {}
    for node in node_rows:
        reported = node.status_of is not None
        inventory: Mapping[str, Any] = node.inventory if reported else {}
        gpus, devices = _gpus(inventory)
        fabrics, gid = _fabrics(inventory)
        node_id = NodeId(str(node.id))
        nodes.append(
            NodeView(
                id=node_id,
                name=node.name,
                pool=node.pool,
                approved=node.approval_state == "approved",
                cordoned=node.cordoned,
                draining=node.draining,
                last_sync_at=_evidence_of_life(
                    node.last_sync_at if reported else None, observing_since
                ),
                gpus=gpus,
                fabrics=fabrics,
                cpu_threads=int(inventory.get("cpu_threads") or 0),
            )
        )
        index_of_key = {g.key: g.index for g in gpus}
        facts[node_id] = _NodeFacts(
            name=node.name,
            mgmt_addr=node.mgmt_addr if reported else "",
            devices=devices,
            placement_index={v: index_of_key[k] for k, v in devices.items()},
            gid_index=gid,
        )

    replica_rows = (await session.execute(select(*Replica.__table__.c))).all()
    shard_rows = (await session.execute(select(*Shard.__table__.c).order_by(Shard.rank))).all()
    gpu_rows = (
        await session.execute(
            select(GpuAssignment.shard_id, GpuAssignment.gpu_index, GpuAssignment.mig_uuid)
            .where(GpuAssignment.shard_released.is_(False))
            .order_by(GpuAssignment.shard_id, GpuAssignment.position)
        )
    ).all()
    devices_of: dict[uuid.UUID, list[Any]] = {}
    for g in gpu_rows:
        devices_of.setdefault(g.shard_id, []).append(g)
    shards_of: dict[uuid.UUID, list[ShardView]] = {}
    for s in shard_rows:
        node_id = NodeId(str(s.node_id))
        placement_index = facts[node_id].placement_index if node_id in facts else {}
        held = devices_of.get(s.id, [])
        keys = [g.mig_uuid or str(g.gpu_index) for g in held]
        indices = [placement_index.get((g.gpu_index, g.mig_uuid), g.gpu_index) for g in held]
        shards_of.setdefault(s.replica_id, []).append(
            ShardView(
                id=ShardId(str(s.id)),
                replica_id=ReplicaId(str(s.replica_id)),
                node_id=node_id,
                rank=s.rank,
                gpu_indices=tuple(indices),
                gpu_keys=tuple(keys),
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
        )
    if broken:
        # A profile that cannot be launched gets no new replicas and loses none: its desired
        # count is frozen at what runs until an admin fixes the profile.
        live: dict[DeploymentId, int] = {}
        for r in replica_rows:
            if r.deployment_id is not None and r.state == "active":
                key = DeploymentId(str(r.deployment_id))
                live[key] = live.get(key, 0) + 1
        deployments = [
            replace(d, replicas=live.get(d.id, 0)) if d.id in broken else d for d in deployments
        ]
    names = {d.id: d.name for d in deployments}
    replicas = tuple(
        ReplicaView(
            id=ReplicaId(str(r.id)),
            deployment_id=DeploymentId(str(r.deployment_id)) if r.deployment_id else None,
            profile_fingerprint=r.profile_fingerprint,
            created_at=r.created_at,
            shards=tuple(shards_of.get(r.id, ())),
            state=r.state,
            drain_deadline=r.drain_deadline,
            reason=r.reason,
        )
        for r in replica_rows
    )
    patterns = tuple(
        (c.name, c.pattern)
        for c in (await session.execute(select(GpuClass).order_by(GpuClass.name))).scalars()
    )
    if patterns:
        base = dict(settings.gpu_class_patterns)
        base.update(patterns)
        settings = replace(settings, gpu_class_patterns=tuple(sorted(base.items())))
    snapshot = Snapshot(
        deployments=tuple(deployments),
        nodes=tuple(nodes),
        replicas=replicas,
        settings=settings,
    )
    return LoadedState(
        snapshot=snapshot,
        nodes=facts,
        launch=launch,
        broken=broken,
        replica_deployment={
            r.id: names.get(r.deployment_id, "") if r.deployment_id else "" for r in replicas
        },
    )


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


async def apply_plan(session: AsyncSession, plan: Plan, state: LoadedState, *, epoch: int) -> None:
    """Write ``plan`` in the caller's transaction (which must have run check_epoch first)."""
    touched: set[uuid.UUID] = set()
    records: list[dict[str, Any]] = []
    replica_nodes: dict[ReplicaId, set[NodeId]] = {
        r.id: {s.node_id for s in r.shards} for r in state.snapshot.replicas
    }
    alive = await _lock_deployments(session, plan, state)
    for a in plan.actions:
        dep_name = state.replica_deployment.get(getattr(a, "replica_id", ReplicaId("")), "")
        if isinstance(a, CreateReplica | UpdateRolloutStatus) and a.deployment_id not in alive:
            continue  # deleted since the snapshot: the next pass drains what it left
        if isinstance(a, CreateReplica):
            dep_name, profile = state.launch[a.deployment_id]
            if profile is None:
                continue  # the planner never places a broken profile; belt and braces
            await _create_replica(session, a, state, profile)
            replica_nodes[a.replica_id] = {p.node_id for p in a.shards}
            touched.update(uuid.UUID(p.node_id) for p in a.shards)
        elif isinstance(a, DrainReplica):
            await session.execute(
                update(Replica)
                .where(Replica.id == uuid.UUID(a.replica_id))
                .values(state="draining", drain_deadline=a.deadline, reason=a.reason)
            )
        elif isinstance(a, StopReplica):
            rid = uuid.UUID(a.replica_id)
            await session.execute(
                update(Replica).where(Replica.id == rid).values(state="stopping", reason=a.reason)
            )
            await session.execute(
                update(Shard)
                .where(Shard.replica_id == rid, Shard.released.is_(False))
                .values(desired_state="stopped")
            )
            touched.update(uuid.UUID(n) for n in replica_nodes.get(a.replica_id, ()))
        elif isinstance(a, ReleaseShard):
            await session.execute(
                update(Shard).where(Shard.id == uuid.UUID(a.shard_id)).values(released=True)
            )
            touched.update(uuid.UUID(n) for n in replica_nodes.get(a.replica_id, ()))
        elif isinstance(a, DeleteReplica):
            await session.execute(delete(Replica).where(Replica.id == uuid.UUID(a.replica_id)))
            touched.update(uuid.UUID(n) for n in replica_nodes.get(a.replica_id, ()))
        elif isinstance(a, SetShardsDesiredState):
            await session.execute(
                update(Shard)
                .where(Shard.replica_id == uuid.UUID(a.replica_id), Shard.released.is_(False))
                .values(desired_state=a.desired_state)
            )
            touched.update(uuid.UUID(n) for n in replica_nodes.get(a.replica_id, ()))
        else:
            assert isinstance(a, UpdateRolloutStatus)
            await _upsert_status(session, a)
            continue  # status changes are visible on the deployment; not an action to record
        node_names = sorted(
            state.nodes[n].name
            for n in replica_nodes.get(getattr(a, "replica_id", ReplicaId("")), ())
            if n in state.nodes
        )
        records.append(
            {
                "epoch": epoch,
                "action": type(a).__name__,
                "deployment": dep_name,
                "replica_id": uuid.UUID(a.replica_id),
                "node": ",".join(node_names)[:1000],
                "reason": a.reason[:4000],
            }
        )
    if touched:
        await session.execute(
            update(Node)
            .where(Node.id.in_(sorted(touched)))
            .values(desired_version=Node.desired_version + 1)
        )
    if records:
        await session.execute(insert(ReconcileAction), records)
        await session.execute(
            text(
                "DELETE FROM reconcile_actions WHERE id <= "
                "(SELECT max(id) FROM reconcile_actions) - :keep"
            ),
            {"keep": ACTION_LOG_KEEP},
        )


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
