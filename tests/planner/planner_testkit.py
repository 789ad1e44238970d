"""Builders for reconcile snapshots, and a small pure simulator of agents.

The simulator stands in for agents the way the real ones behave on the wire:
a shard desired running goes pending -> starting -> ready, one step each; a
shard desired stopped is stopped and, as the agent API does on the next report of an
agent that has applied that set, released; nodes in `dead` stop syncing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from llmgw.engines.requirements import PlacementRequirements
from llmgw.planner import (
    GPU,
    DeploymentId,
    DeploymentView,
    Fabric,
    FabricName,
    NodeId,
    NodeView,
    Plan,
    PlanSettings,
    ProfileView,
    ReplicaView,
    ShardView,
    Snapshot,
    apply_to_snapshot,
    compute_plan,
    serving,
)

__all__ = [
    "H100",
    "SETTINGS",
    "T0",
    "agents_step",
    "deployment",
    "node",
    "profile",
    "ready_count",
    "requirements",
    "run_until_settled",
    "snapshot",
    "step",
]

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
H100 = "NVIDIA H100 80GB HBM3"
SETTINGS = PlanSettings(
    sync_period_s=2.0,
    sync_grace_s=10.0,
    drain_timeout_s=30.0,
    crash_loop_restarts=3,
    leader_port_min=29500,
    leader_port_max=29509,
    gpu_class_patterns=(("h100", "H100"), ("h200", "H200"), ("sim", "^sim$")),
)


def requirements(
    gpus: int = 1,
    nodes: int = 1,
    *,
    gpu_class: str = "h100",
    threads: int = 0,
    mig: bool | None = None,
    uniform: bool = False,
) -> PlacementRequirements:
    cpu = gpu_class == "cpu"
    return PlacementRequirements(
        gpu_class=gpu_class,
        nodes=nodes,
        gpus_per_node=0 if cpu else gpus,
        threads=threads,
        cpu_only=cpu,
        mig_allowed=(gpus == 1 and nodes == 1 and not cpu) if mig is None else mig,
        same_gpu_indices_across_nodes=uniform,
        same_hcas_across_nodes=uniform,
    )


def profile(fingerprint: str = "fp-1", engine: str = "vllm", **kw: object) -> ProfileView:
    return ProfileView("p", engine, fingerprint, requirements(**kw))  # type: ignore[arg-type]


def deployment(
    name: str = "d",
    replicas: int = 1,
    prof: ProfileView | None = None,
    **kw: object,
) -> DeploymentView:
    return DeploymentView(
        id=DeploymentId(name),
        name=name,
        profile=prof or profile(),
        replicas=replicas,
        **kw,  # type: ignore[arg-type]
    )


def node(
    name: str,
    gpus: int = 8,
    *,
    gpu_name: str = H100,
    fabrics: Iterable[str] = (),
    mig: dict[int, int] | None = None,
    synced: datetime | None = T0,
    threads: int = 0,
    **kw: object,
) -> NodeView:
    """`mig` maps a GPU index to how many MIG instances it is carved into."""
    devs = [GPU(i, gpu_name, f"GPU-{name}-{i}") for i in range(gpus)]
    nxt = 1000
    for parent, count in sorted((mig or {}).items()):
        for _ in range(count):
            devs.append(GPU(nxt, f"{gpu_name} MIG 1g.10gb", f"MIG-{name}-{nxt}", parent))
            nxt += 1
    fabs = tuple(
        Fabric(FabricName(f), () if f.startswith("nvl:") else (f"mlx5_{f}",)) for f in fabrics
    )
    return NodeView(
        id=NodeId(name),
        name=name,
        gpus=tuple(devs),
        fabrics=fabs,
        last_sync_at=synced,
        cpu_threads=threads,
        **kw,  # type: ignore[arg-type]
    )


def snapshot(
    deployments: Iterable[DeploymentView],
    nodes: Iterable[NodeView],
    replicas: Iterable[ReplicaView] = (),
    settings: PlanSettings = SETTINGS,
) -> Snapshot:
    return Snapshot(tuple(deployments), tuple(nodes), tuple(replicas), settings)


def _agent(s: ShardView) -> ShardView:
    if s.released:
        return s
    if s.desired_state == "stopped":
        return replace(s, observed_state="exited", released=True)
    if s.desired_state == "running" and s.observed_state in ("pending", "exited"):
        return replace(s, observed_state="starting")
    if s.desired_state == "running" and s.observed_state == "starting":
        return replace(s, observed_state="ready")
    return s


def agents_step(snap: Snapshot, now: datetime, dead: frozenset[str] = frozenset()) -> Snapshot:
    """One sync of every live agent: nodes not in `dead` sync now and move their shards on."""
    alive = {n.id for n in snap.nodes if n.name not in dead}
    nodes = tuple(replace(n, last_sync_at=now) if n.id in alive else n for n in snap.nodes)
    replicas = tuple(
        replace(r, shards=tuple(_agent(s) if s.node_id in alive else s for s in r.shards))
        for r in snap.replicas
    )
    return replace(snap, nodes=nodes, replicas=replicas)


def step(snap: Snapshot, now: datetime) -> tuple[Snapshot, Plan]:
    """Plan, then apply: what one reconcile pass does."""
    plan = compute_plan(snap, now)
    return apply_to_snapshot(snap, plan, now), plan


def ready_count(snap: Snapshot, deployment_name: str) -> int:
    return sum(1 for r in snap.replicas if r.deployment_id == deployment_name and serving(r))


def run_until_settled(
    snap: Snapshot, now: datetime, *, max_steps: int = 60, dt_s: float = 5.0
) -> tuple[Snapshot, datetime, int]:
    """Reconcile and let agents act until a pass plans nothing; (state, time, steps)."""
    for i in range(max_steps):
        snap, plan = step(snap, now)
        moved = agents_step(snap, now)
        waiting = any(r.state == "draining" for r in snap.replicas)
        if not plan.actions and moved.replicas == snap.replicas and not waiting:
            return snap, now, i
        now += timedelta(seconds=dt_s)
        snap = agents_step(snap, now)
    raise AssertionError(f"not settled after {max_steps} steps")
