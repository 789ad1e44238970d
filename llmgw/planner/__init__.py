"""The reconciler's pure core: placement and the plan (docs/architecture.md §4).

A snapshot of desired and observed state goes in, a plan of actions comes
out; nothing here touches the database, the network or the environment (a
test walks the imports). The shell loads the snapshot in a constant number
of queries and applies the plan in one transaction fenced by the leader epoch.

    plan = compute_plan(snapshot, now)
    for action in plan.actions: ...          # the shell, in SQL
    assert not compute_plan(apply_to_snapshot(snapshot, plan, now), now)
"""

from llmgw.planner.actions import (
    Action,
    CreateReplica,
    DeleteReplica,
    DrainReplica,
    Plan,
    ReleaseShard,
    SetShardsDesiredState,
    ShardPlacement,
    StopReplica,
    UpdateRolloutStatus,
)
from llmgw.planner.apply import apply_actions, apply_to_snapshot
from llmgw.planner.capacity import Capacity, GPUClassifier, node_is_syncing
from llmgw.planner.placement import (
    NodeAssignment,
    Placement,
    PlacementRequest,
    Unplaceable,
    place_replica,
)
from llmgw.planner.plan import compute_plan
from llmgw.planner.replicas import serving
from llmgw.planner.rollout import RolloutBudget, resolve_budget, rollout_budget
from llmgw.planner.snapshot import (
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
from llmgw.planner.status import compute_status

__all__ = [
    "GPU",
    "SIM_GPU_CLASS",
    "Action",
    "Capacity",
    "CreateReplica",
    "DeleteReplica",
    "DeploymentId",
    "DeploymentView",
    "DrainReplica",
    "Fabric",
    "FabricName",
    "GPUClassifier",
    "NodeAssignment",
    "NodeId",
    "NodeView",
    "Placement",
    "PlacementRequest",
    "PlacementRequirements",
    "Plan",
    "PlanSettings",
    "ProfileView",
    "ReleaseShard",
    "ReplicaId",
    "ReplicaView",
    "RolloutBudget",
    "RolloutStatus",
    "SetShardsDesiredState",
    "ShardId",
    "ShardPlacement",
    "ShardView",
    "Snapshot",
    "StopReplica",
    "Unplaceable",
    "UpdateRolloutStatus",
    "apply_actions",
    "apply_to_snapshot",
    "compute_plan",
    "compute_status",
    "node_is_syncing",
    "place_replica",
    "resolve_budget",
    "rollout_budget",
    "serving",
]
