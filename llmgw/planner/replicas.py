"""Facts about replicas the planner and the status share: serving, gone, in trouble, stale.

One place decides what "ready", "crash-looping" and "needs to move" mean, so
the plan and the status it reports can never disagree. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from llmgw.planner.capacity import node_is_syncing
from llmgw.planner.snapshot import (
    DeploymentView,
    NodeId,
    NodeView,
    PlanSettings,
    ReplicaView,
    ShardView,
)

__all__ = [
    "Classified",
    "classify",
    "crash_looping",
    "serving",
    "shard_gone",
]


def serving(r: ReplicaView) -> bool:
    """Every shard desired running and reported ready: what the gateway may route to."""
    return r.state == "active" and all(
        s.desired_state == "running" and s.observed_state == "ready" for s in r.shards
    )


def shard_gone(s: ShardView, nodes: dict[NodeId, NodeView]) -> bool:
    """The shard was released, or its node was deleted (no agent will ever report).

    Released, not merely observed `exited`/`failed`: those may have been reported before the
    agent saw the stop (`exited` is a crash with a restart pending), and an engine that comes
    back on GPUs the plan counts as free would share them. The agent API releases a shard
    only on a report from an agent that has applied the set in which it is stopped.
    """
    return s.released or s.node_id not in nodes


def crash_looping(s: ShardView, settings: PlanSettings) -> bool:
    return s.observed_state == "failed" or s.restarts >= settings.crash_loop_restarts


def _trouble(
    r: ReplicaView, nodes: dict[NodeId, NodeView], now: datetime, settings: PlanSettings
) -> str | None:
    """Why the replica must be stopped and replaced at once, without waiting on the budget:
    it is unreachable or unstable, so keeping it protects no availability."""
    for s in r.shards:
        node = nodes.get(s.node_id)
        if node is None:
            return f"node {s.node_id} was deleted"
        if not node_is_syncing(node, now, settings):
            if node.last_sync_at is None:
                return f"node {node.name} never synced"
            age = (now - node.last_sync_at).total_seconds()
            return (
                f"node {node.name} stopped syncing: last sync {age:.0f} s ago "
                f"(grace {settings.sync_grace_s:g} s)"
            )
    for s in r.shards:
        if crash_looping(s, settings):
            node_name = nodes[s.node_id].name
            last = f"; last: {s.observed_reason}" if s.observed_reason else ""
            return (
                f"shard rank {s.rank} on node {node_name} is crash-looping: "
                f"{s.observed_state}, {s.restarts} restarts "
                f"(limit {settings.crash_loop_restarts}){last}"
            )
    return None


@dataclass(frozen=True, slots=True)
class Classified:
    """A deployment's active replicas, sorted by what the plan does with them."""

    # Current fingerprint, on a node that stays: what the rollout converges to.
    current: tuple[ReplicaView, ...]
    # (replica, why): stale fingerprint or on a draining node; replaced under the budget.
    old: tuple[tuple[ReplicaView, str], ...]
    # (replica, why): unreachable or crash-looping; stopped and replaced now.
    broken: tuple[tuple[ReplicaView, str], ...]


def classify(
    d: DeploymentView,
    active: list[ReplicaView],
    nodes: dict[NodeId, NodeView],
    now: datetime,
    settings: PlanSettings,
) -> Classified:
    current, old, broken = [], [], []
    for r in active:
        trouble = _trouble(r, nodes, now, settings)
        if trouble is not None:
            broken.append((r, trouble))
            continue
        draining_node = next(
            (nodes[s.node_id].name for s in r.shards if nodes[s.node_id].draining), None
        )
        if draining_node is not None:
            old.append((r, f"node {draining_node} is draining"))
        elif r.profile_fingerprint != d.profile.fingerprint:
            old.append(
                (
                    r,
                    f"profile fingerprint {r.profile_fingerprint[:12]} is stale "
                    f"(now {d.profile.fingerprint[:12]})",
                )
            )
        else:
            current.append(r)
    return Classified(tuple(current), tuple(old), tuple(broken))
