"""What the planner sees: desired and observed state as frozen values.

The store (``store/reconcile/read.py``) turns rows into these in a constant
number of queries, by the rules of ``intake.py``; the pure planner and
placement read nothing else. This module must NOT import sqlalchemy, open
anything or read the environment: a snapshot is a value, so a test can build
one by hand and a bug can be replayed from a dump.

Who writes what (docs/architecture.md §3): deployments, profiles and the admin half of a
node (cordon, pool, approval) come from operators; inventory, last sync and
the observed half of a shard from agents; replica lifecycle, the desired
half of a shard and rollout status from the reconciler itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, NewType

from llmgw.engines.requirements import PlacementRequirements
from llmgw.engines.spec import CPU_GPU_CLASS, ReplicaId, ShardId
from llmgw.errors import ConfigError
from llmgw.planner.autoscale import AutoscalePolicy

__all__ = [
    "CPU_GPU_CLASS",
    "GPU",
    "SIM_GPU_CLASS",
    "DeploymentId",
    "DeploymentView",
    "Fabric",
    "FabricName",
    "NodeId",
    "NodeView",
    "ObservedState",
    "PlacementRequirements",
    "PlanSettings",
    "ProfileView",
    "ReplicaId",
    "ReplicaState",
    "ReplicaView",
    "RolloutStatus",
    "ShardDesiredState",
    "ShardId",
    "ShardView",
    "Snapshot",
]

NodeId = NewType("NodeId", str)
DeploymentId = NewType("DeploymentId", str)
# "ib0", "roce-a", or "nvl:<domain>" for a multi-node NVLink domain.
FabricName = NewType("FabricName", str)

# Simulated GPUs report this name and resolve to this class; only the `sim`
# engine may run on them, whatever the class patterns say (a pattern such as
# ".*" must never put a real engine on a GPU that does not exist).
SIM_GPU_CLASS = "sim"

ShardDesiredState = Literal["running", "suspended", "stopped"]
ObservedState = Literal["pending", "starting", "ready", "unhealthy", "draining", "exited", "failed"]
# active: serving or on its way; draining: excluded from routing, engines still
# running until idle or drain_deadline; stopping: shards desired stopped, the row
# stays until every shard is observed gone (then released and deleted).
ReplicaState = Literal["active", "draining", "stopping"]


@dataclass(frozen=True, slots=True)
class GPU:
    """One GPU or MIG instance as the agent reported it."""

    # nvidia-smi's index; MIG instances are numbered from 1000 (the seed's rule).
    index: int
    # The NVML name, matched against the class patterns ("NVIDIA H100 80GB HBM3").
    name: str
    uuid: str = ""
    # Index of the GPU a MIG instance is carved from; None for a whole GPU.
    mig_parent: int | None = None

    @property
    def mig(self) -> bool:
        return self.mig_parent is not None

    @property
    def key(self) -> str:
        """The gpu_assignments key: "3" for GPU 3, "MIG-<uuid>" for an instance."""
        if self.mig:
            return self.uuid if self.uuid.startswith("MIG-") else f"MIG-{self.uuid or self.index}"
        return str(self.index)


@dataclass(frozen=True, slots=True)
class Fabric:
    name: FabricName
    # The adapters of this fabric on this node, in the order NCCL should get them.
    hcas: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeView:
    id: NodeId
    name: str
    pool: str = "default"
    approved: bool = True
    cordoned: bool = False
    # An admin asked to move everything off: implies cordoned for placement.
    draining: bool = False
    # The node's evidence of life (intake.evidence_of_life: its last sync, or when the
    # leader began watching if later). None: the agent never synced; placement and
    # liveness treat it as not syncing.
    last_sync_at: datetime | None = None
    gpus: tuple[GPU, ...] = ()
    fabrics: tuple[Fabric, ...] = ()
    cpu_threads: int = 0


@dataclass(frozen=True, slots=True)
class ProfileView:
    name: str
    engine: str
    fingerprint: str
    # From llmgw.engines.placement_requirements(profile), so the engines'
    # rules (data parallelism counted, mpirun's uniform ranks) live in one place.
    requirements: PlacementRequirements
    # Why its engine stops a replica the control plane wants asleep rather than suspending it
    # (llmgw.engines Engine.suspend_refusal: vLLM without sleep mode, or on the CPU); "": it
    # suspends. The autoscaler then stops idle replicas, and status says the engines stopped.
    suspend_refusal: str = ""

    @property
    def gpu_class(self) -> str:
        return self.requirements.gpu_class


@dataclass(frozen=True, slots=True)
class RolloutStatus:
    """A deployment's status as the reconciler last wrote it (Kubernetes' names)."""

    observed_generation: int = 0
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    available_replicas: int = 0
    unavailable_replicas: int = 0
    # Active replicas kept placed with their engines suspended (not counted ready).
    suspended_replicas: int = 0
    stalled: bool = False
    # Why the rollout is where it is, for people: placement explanations included.
    reason: str = ""
    # When the current unfinished stretch began or last made progress; None when complete.
    progress_started_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class DeploymentView:
    id: DeploymentId
    name: str
    profile: ProfileView
    replicas: int
    pool: str = "default"
    # As written: "1" or "25%" (resolved against `replicas` each pass).
    max_surge: str = "1"
    max_unavailable: str = "0"
    progress_deadline_s: int = 600
    suspended: bool = False
    # Bumped on every admin edit; status.observed_generation echoes it.
    generation: int = 1
    status: RolloutStatus = field(default_factory=RolloutStatus)
    # The autoscale policy; None: `replicas` is the operator's, fixed. With one, `replicas`
    # is what the autoscaler decided should serve (planner/autoscale.py).
    autoscale: AutoscalePolicy | None = None
    # Replicas to keep placed, serving plus suspended (>= replicas); None: `replicas`. The
    # ones above `replicas` are suspended, not drained: a wake is a resume, not a start.
    warm_replicas: int | None = None

    @property
    def placed_replicas(self) -> int:
        return (
            self.replicas if self.warm_replicas is None else max(self.warm_replicas, self.replicas)
        )


@dataclass(frozen=True, slots=True)
class ShardView:
    id: ShardId
    replica_id: ReplicaId
    node_id: NodeId
    rank: int
    gpu_indices: tuple[int, ...] = ()
    gpu_keys: tuple[str, ...] = ()
    hcas: tuple[str, ...] = ()
    fabric: str = ""
    # Only rank 0 holds one: the distributed-init endpoint on its node.
    leader_port: int | None = None
    threads: int = 0
    desired_state: ShardDesiredState = "running"
    # Set once the agent reported the engine gone after a stop: GPUs and port are free.
    released: bool = False
    # --- the agent's half ---
    observed_state: ObservedState = "pending"
    observed_reason: str = ""
    restarts: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaView:
    id: ReplicaId
    # None once the deployment was deleted (the foreign key is SET NULL).
    deployment_id: DeploymentId | None
    profile_fingerprint: str
    created_at: datetime
    shards: tuple[ShardView, ...]
    state: ReplicaState = "active"
    drain_deadline: datetime | None = None
    # Why the replica is draining or stopping, as the action that did it said.
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PlanSettings:
    sync_period_s: float = 2.0
    # A node whose last sync is older than this is not syncing: its replicas are
    # replaced and it gets nothing new. At least 5 sync periods (docs/architecture.md §4), so a
    # node that missed a few syncs under load is not emptied.
    sync_grace_s: float = 10.0
    drain_timeout_s: float = 30.0
    # A shard restarted this many times (or observed failed) has its replica replaced.
    crash_loop_restarts: int = 5
    # Leader ports per node, inclusive.
    leader_port_min: int = 29500
    leader_port_max: int = 29999
    # GPU class -> regex searched in NVML GPU names, e.g. (("h100", "H100"), ("sim", "^sim$")).
    gpu_class_patterns: tuple[tuple[str, str], ...] = ((SIM_GPU_CLASS, "^sim$"),)

    def __post_init__(self) -> None:
        if self.sync_grace_s < 5 * self.sync_period_s:
            raise ConfigError(
                f"sync grace {self.sync_grace_s:g} s is shorter than 5 sync periods "
                f"({5 * self.sync_period_s:g} s): a node that misses a few syncs under load "
                "would have all its replicas replaced; raise the grace",
                field="sync_grace_s",
            )
        if not 1 <= self.leader_port_min <= self.leader_port_max <= 65535:
            raise ConfigError(
                f"leader port range {self.leader_port_min}-{self.leader_port_max} is not a "
                "range of TCP ports; give 1 <= min <= max <= 65535",
                field="leader_port_min",
            )
        if self.crash_loop_restarts < 1:
            raise ConfigError(
                f"crash_loop_restarts {self.crash_loop_restarts} must be at least 1",
                field="crash_loop_restarts",
            )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one reconcile pass reads, consistent as of one transaction."""

    deployments: tuple[DeploymentView, ...]
    nodes: tuple[NodeView, ...]
    replicas: tuple[ReplicaView, ...]
    settings: PlanSettings = field(default_factory=PlanSettings)
