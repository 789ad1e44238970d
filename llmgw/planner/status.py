"""Rollout status per deployment, derived from the state the plan leads to.

Status is computed on the snapshot *after* the plan's own actions, and from
state alone (never from which actions this pass took), so planning again on
the written result finds the same status and writes nothing. A rollout that
made no progress (more updated or ready replicas) for `progress_deadline_s`
is marked stalled, with the reason it is stuck. Pure: no I/O.
"""

from __future__ import annotations

from datetime import datetime

from llmgw.planner.actions import UpdateRolloutStatus
from llmgw.planner.placement import Unplaceable
from llmgw.planner.replicas import classify, serving
from llmgw.planner.rollout import rollout_budget
from llmgw.planner.snapshot import (
    DeploymentId,
    DeploymentView,
    NodeId,
    NodeView,
    ReplicaView,
    RolloutStatus,
    Snapshot,
)

__all__ = ["compute_status", "status_actions"]


def _reason(
    d: DeploymentView,
    *,
    complete: bool,
    num_active: int,
    updated: int,
    ready: int,
    num_old: int,
    num_draining: int,
    num_stopping: int,
    unplaced: Unplaceable | None,
) -> str:
    if d.suspended:
        return f"suspended: {num_active} replicas keep their placement, {_engines_asleep(d)}"
    if complete:
        return f"complete: {ready} of {d.replicas} replicas ready"
    parts = [f"{updated} of {d.replicas} replicas updated, {ready} ready"]
    if num_old:
        parts.append(f"{num_old} to replace")
    if num_draining:
        parts.append(f"{num_draining} draining")
    if unplaced is not None:
        parts.append(f"cannot place a replica: {unplaced.explain()}")
        if num_draining:
            parts.append("waiting for draining replicas to free their GPUs")
        elif num_stopping:
            # Scaled to zero and woken at once: the stopped replicas still hold their GPUs
            # until their agents report them gone; the placement frees itself.
            parts.append("waiting for stopping replicas to free their GPUs")
        elif num_old:
            budget = rollout_budget(d.max_surge, d.max_unavailable, d.replicas)
            parts.append(
                f"no capacity for a surge replica: replacing in place within max_unavailable "
                f"{budget.max_unavailable}"
                if budget.max_unavailable
                else "max_unavailable is 0, so old replicas cannot be replaced in place: "
                "add capacity or raise max_unavailable"
            )
    return "; ".join(parts)


def _engines_asleep(d: DeploymentView) -> str:
    """What the agents did with the engines of replicas desired suspended."""
    refusal = d.profile.suspend_refusal
    return f"engines stopped: {refusal}" if refusal else "engines suspended"


def compute_status(
    d: DeploymentView,
    replicas: list[ReplicaView],
    nodes: dict[NodeId, NodeView],
    snapshot: Snapshot,
    now: datetime,
    unplaced: Unplaceable | None,
) -> RolloutStatus:
    active = [r for r in replicas if r.state == "active"]
    c = classify(d, active, nodes, now, snapshot.settings)
    updated = len(c.current)
    ready = sum(1 for r in active if serving(r))
    num_draining = sum(1 for r in replicas if r.state == "draining")
    num_stopping = sum(1 for r in replicas if r.state == "stopping")
    num_suspended = sum(1 for r in active if any(s.desired_state == "suspended" for s in r.shards))
    # An autoscaler's suspended replicas are placed as desired: they count toward done.
    placed = d.placed_replicas
    complete = (
        not d.suspended
        and updated == placed
        and len(active) == placed
        and ready == updated - num_suspended
    )
    stored = d.status
    progressed = (
        stored.observed_generation != d.generation
        or updated > stored.updated_replicas
        or ready > stored.ready_replicas
    )
    start: datetime | None = None
    if not (complete or d.suspended):
        start = (
            now if progressed or stored.progress_started_at is None else stored.progress_started_at
        )
    stalled = start is not None and (now - start).total_seconds() > d.progress_deadline_s
    reason = _reason(
        d,
        complete=complete,
        num_active=len(active),
        updated=updated,
        ready=ready,
        num_old=len(c.old),
        num_draining=num_draining,
        num_stopping=num_stopping,
        unplaced=unplaced,
    )
    if num_suspended and not d.suspended:
        refusal = d.profile.suspend_refusal
        reason = f"{reason}; {num_suspended} suspended"
        if refusal:
            reason = f"{reason} ({_engines_asleep(d)})"
    if stalled:
        reason = f"progress deadline {d.progress_deadline_s} s exceeded: {reason}"
    return RolloutStatus(
        observed_generation=d.generation,
        replicas=len(active),
        ready_replicas=ready,
        updated_replicas=updated,
        available_replicas=ready,
        unavailable_replicas=max(d.replicas - ready, 0),
        suspended_replicas=num_suspended,
        stalled=stalled,
        reason=reason,
        progress_started_at=start,
    )


def status_actions(
    before: Snapshot,
    after: Snapshot,
    now: datetime,
    unplaced: dict[DeploymentId, Unplaceable],
) -> list[UpdateRolloutStatus]:
    """A status update for each deployment whose status differs from the one stored."""
    nodes = {n.id: n for n in after.nodes}
    by_deployment: dict[DeploymentId, list[ReplicaView]] = {}
    for r in after.replicas:
        if r.deployment_id is not None:
            by_deployment.setdefault(r.deployment_id, []).append(r)
    stored = {d.id: d.status for d in before.deployments}
    out = []
    for d in sorted(after.deployments, key=lambda d: d.name):
        status = compute_status(
            d, by_deployment.get(d.id, []), nodes, after, now, unplaced.get(d.id)
        )
        if status != stored[d.id]:
            out.append(UpdateRolloutStatus(d.id, status, status.reason))
    return out
