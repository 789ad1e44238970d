"""A plan applied to a snapshot, in memory: what the shell's transaction will do in SQL.

The planner uses it to see the state its own actions lead to (so one plan
carries a replica from "stop" to "delete" when nothing is left to wait for,
and status is computed on the result), and tests use it to check that planning
again after applying yields nothing. Actions apply in order. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from llmgw.planner.actions import (
    Action,
    CreateReplica,
    DeleteReplica,
    DrainReplica,
    Plan,
    ReleaseShard,
    SetShardsDesiredState,
    StopReplica,
    UpdateRolloutStatus,
)
from llmgw.planner.snapshot import (
    DeploymentId,
    DeploymentView,
    ReplicaId,
    ReplicaView,
    ShardDesiredState,
    ShardView,
    Snapshot,
)

__all__ = ["apply_actions", "apply_to_snapshot"]


def _created(a: CreateReplica, now: datetime) -> ReplicaView:
    shards = tuple(
        ShardView(
            id=p.shard_id,
            replica_id=a.replica_id,
            node_id=p.node_id,
            rank=p.rank,
            gpu_indices=p.gpu_indices,
            gpu_keys=p.gpu_keys,
            hcas=p.hcas,
            fabric=p.fabric,
            leader_port=p.leader_port,
            threads=p.threads,
            desired_state=p.desired_state,
        )
        for p in a.shards
    )
    return ReplicaView(a.replica_id, a.deployment_id, a.profile_fingerprint, now, shards)


def _set_desired(r: ReplicaView, state: ShardDesiredState) -> ReplicaView:
    shards = tuple(
        s if s.released or s.desired_state == state else replace(s, desired_state=state)
        for s in r.shards
    )
    return replace(r, shards=shards)


def apply_actions(snapshot: Snapshot, actions: tuple[Action, ...], now: datetime) -> Snapshot:
    replicas: dict[ReplicaId, ReplicaView] = {r.id: r for r in snapshot.replicas}
    deployments: dict[DeploymentId, DeploymentView] = {d.id: d for d in snapshot.deployments}
    for a in actions:
        if isinstance(a, CreateReplica):
            replicas[a.replica_id] = _created(a, now)
        elif isinstance(a, DrainReplica):
            r = replicas[a.replica_id]
            replicas[a.replica_id] = replace(
                r, state="draining", drain_deadline=a.deadline, reason=a.reason
            )
        elif isinstance(a, StopReplica):
            r = replicas[a.replica_id]
            replicas[a.replica_id] = replace(
                _set_desired(r, "stopped"), state="stopping", reason=a.reason
            )
        elif isinstance(a, ReleaseShard):
            r = replicas[a.replica_id]
            shards = tuple(replace(s, released=True) if s.id == a.shard_id else s for s in r.shards)
            replicas[a.replica_id] = replace(r, shards=shards)
        elif isinstance(a, DeleteReplica):
            del replicas[a.replica_id]
        elif isinstance(a, SetShardsDesiredState):
            replicas[a.replica_id] = _set_desired(replicas[a.replica_id], a.desired_state)
        else:
            assert isinstance(a, UpdateRolloutStatus)
            deployments[a.deployment_id] = replace(deployments[a.deployment_id], status=a.status)
    return replace(
        snapshot,
        replicas=tuple(replicas.values()),
        deployments=tuple(deployments[d.id] for d in snapshot.deployments),
    )


def apply_to_snapshot(snapshot: Snapshot, plan: Plan, now: datetime) -> Snapshot:
    """The snapshot after `plan` has been applied at `now`."""
    return apply_actions(snapshot, plan.actions, now)
