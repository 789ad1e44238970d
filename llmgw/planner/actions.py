"""The closed set of things a plan may ask the shell to do, and the plan itself.

Each action is a frozen value with a `reason` the shell writes to the action
record, so "why did my replica restart?" has an answer. Actions carry the
decision, not the SQL: the shell maps each to its statements in one
transaction after checking the leader epoch, in plan order (a later action
may refer to a replica an earlier one created). What each means in the store,
exactly as `apply.apply_actions` does it in memory:

    CreateReplica         insert the replica (state active) and its shards (desired
                          running, observed pending), one gpu_assignments row per
                          gpu_key; build each ShardSpec from the profile (rank > 0
                          gets rank 0's leader_port as its endpoint)
    DrainReplica          state draining + drain_deadline: gateways stop routing to it
    StopReplica           state stopping, every unreleased shard desired stopped
    ReleaseShard          released = true, its gpu_assignments rows deleted
    DeleteReplica         delete the replica (shards and assignments cascade)
    SetShardsDesiredState desired_state of its unreleased shards
    UpdateRolloutStatus   the deployment's status columns (never its admin version)

Every action that changes a shard's desired half bumps `desired_version` of
that shard's node in the same transaction (agents pull on that ETag).
Nothing here does I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime

from llmgw.planner.snapshot import (
    DeploymentId,
    NodeId,
    ReplicaId,
    RolloutStatus,
    ShardDesiredState,
    ShardId,
)

__all__ = [
    "Action",
    "CreateReplica",
    "DeleteReplica",
    "DrainReplica",
    "Plan",
    "ReleaseShard",
    "SetShardsDesiredState",
    "ShardPlacement",
    "StopReplica",
    "UpdateRolloutStatus",
]


@dataclass(frozen=True, slots=True)
class ShardPlacement:
    shard_id: ShardId
    node_id: NodeId
    rank: int
    gpu_indices: tuple[int, ...]
    gpu_keys: tuple[str, ...]
    hcas: tuple[str, ...]
    fabric: str
    leader_port: int | None
    threads: int
    desired_state: ShardDesiredState


@dataclass(frozen=True, slots=True)
class CreateReplica:
    replica_id: ReplicaId
    deployment_id: DeploymentId
    profile_fingerprint: str
    shards: tuple[ShardPlacement, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class DrainReplica:
    """Take the replica out of routing; its engines run until idle or the deadline."""

    replica_id: ReplicaId
    deadline: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class StopReplica:
    """Every shard desired `stopped`; the row stays until agents report them gone."""

    replica_id: ReplicaId
    reason: str


@dataclass(frozen=True, slots=True)
class ReleaseShard:
    """The agent reported the engine gone: free its GPUs, threads and leader port."""

    shard_id: ShardId
    replica_id: ReplicaId
    reason: str


@dataclass(frozen=True, slots=True)
class DeleteReplica:
    """Every shard is gone: delete the replica and its shard rows."""

    replica_id: ReplicaId
    reason: str


@dataclass(frozen=True, slots=True)
class SetShardsDesiredState:
    """Suspend or resume a replica's engines without moving them."""

    replica_id: ReplicaId
    desired_state: ShardDesiredState
    reason: str


@dataclass(frozen=True, slots=True)
class UpdateRolloutStatus:
    deployment_id: DeploymentId
    status: RolloutStatus
    reason: str


Action = (
    CreateReplica
    | DrainReplica
    | StopReplica
    | ReleaseShard
    | DeleteReplica
    | SetShardsDesiredState
    | UpdateRolloutStatus
)


@dataclass(frozen=True, slots=True)
class Plan:
    now: datetime
    actions: tuple[Action, ...]
    # Deployment name -> why replicas it wants could not be placed this pass
    # (the text also lands in its rollout status reason).
    unplaced: tuple[tuple[str, str], ...] = ()

    def counts(self) -> dict[str, int]:
        """Actions by kind, for the pass's log line and metrics."""
        return dict(Counter(type(a).__name__ for a in self.actions))

    def __bool__(self) -> bool:
        return bool(self.actions)
