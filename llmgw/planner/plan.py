"""compute_plan: desired + observed state in, the actions that converge them out.

Level-triggered: the plan depends on the snapshot and `now` only, never on
what happened before, so a lost or repeated pass does no harm. Idempotent:
the planner applies its own actions to the snapshot in memory and plans
again until nothing is left (a replica whose engines are already gone goes
from "stop" to "delete" in one plan), then derives rollout status from that
result; planning on the snapshot the shell writes therefore yields nothing.

What one round decides, per deployment (sorted by name, so a pass is
deterministic) and for replicas whose deployment was deleted:
- replicas on nodes that stopped syncing, or with a crash-looping shard:
  stopped now and replaced (avoiding the crash loop's nodes);
- surplus replicas: drained (out of routing, stopped when idle or at the
  drain deadline), unready ones stopped at once;
- stale replicas (old fingerprint, or on a draining node): replaced surge
  first within max_surge; old ready replicas removed only while the ready
  count stays at or above desired - max_unavailable; when no surge replica
  can be placed, replaced in place within max_unavailable, and the reason
  says so. Whole replicas only;
- suspended deployments: shards desired `suspended`, placement kept.
This module must NOT do I/O: the shell loads the snapshot and applies the plan.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

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
)
from llmgw.planner.apply import apply_actions
from llmgw.planner.capacity import Capacity
from llmgw.planner.placement import (
    Placement,
    PlacementRequest,
    Unplaceable,
    place_replica,
)
from llmgw.planner.replicas import (
    classify,
    crash_looping,
    serving,
    shard_gone,
)
from llmgw.planner.rollout import rollout_budget
from llmgw.planner.snapshot import (
    DeploymentId,
    DeploymentView,
    NodeId,
    NodeView,
    ReplicaId,
    ReplicaView,
    ShardId,
    Snapshot,
)
from llmgw.planner.status import status_actions

__all__ = ["compute_plan"]

# Rounds of plan-then-apply-in-memory per pass. Each round moves a replica at
# most one step (drain -> stop -> delete -> its GPUs placed again), so a few
# suffice; the bound only guards against a rule that would never settle.
_MAX_ROUNDS = 8

# Replica ids are derived, not random, so a plan is a pure function of its input.
_ID_NAMESPACE = uuid.UUID("6f1c0b8e-8a59-4c55-9d0e-2f4e1d1b7a31")


@dataclass(slots=True)
class _Round:
    snap: Snapshot
    now: datetime
    nodes: dict[NodeId, NodeView]
    used_ids: set[ReplicaId]
    actions: list[Action] = field(default_factory=list)
    unplaced: dict[DeploymentId, Unplaceable] = field(default_factory=dict)
    # Built on the first placement: a pass that places nothing never pays for it.
    _cap: Capacity | None = None

    @property
    def cap(self) -> Capacity:
        if self._cap is None:
            self._cap = Capacity(self.snap, self.now)
        return self._cap

    # --- retiring replicas ---

    def retire(self, r: ReplicaView, reason: str, *, drain: bool) -> None:
        """Drain a serving replica (gateways stop choosing it first); stop anything else."""
        if drain and serving(r):
            deadline = self.now + timedelta(seconds=self.snap.settings.drain_timeout_s)
            self.actions.append(DrainReplica(r.id, deadline, reason))
        else:
            self.actions.append(StopReplica(r.id, reason))

    def finish(self, r: ReplicaView) -> None:
        """Move a draining or stopping replica on, once what it waits for happened."""
        if r.state == "draining":
            # No deadline recorded (a row written by hand) means no reason to wait.
            if r.drain_deadline is None or self.now >= r.drain_deadline:
                self.actions.append(StopReplica(r.id, f"drain deadline passed: {r.reason}"))
            elif all(shard_gone(s, self.nodes) for s in r.shards):
                self.actions.append(StopReplica(r.id, f"drained: {r.reason}"))
            return
        gone = [s for s in r.shards if shard_gone(s, self.nodes)]
        if len(gone) == len(r.shards):
            self.actions.append(DeleteReplica(r.id, f"every shard exited: {r.reason}"))
            return
        for s in gone:
            if not s.released:
                self.actions.append(
                    ReleaseShard(s.id, r.id, f"shard rank {s.rank} exited: {r.reason}")
                )

    # --- creating replicas ---

    def new_id(self, d: DeploymentView) -> ReplicaId:
        n = 0
        while True:
            rid = ReplicaId(str(uuid.uuid5(_ID_NAMESPACE, f"{d.id}/{self.now.isoformat()}/{n}")))
            if rid not in self.used_ids:
                self.used_ids.add(rid)
                return rid
            n += 1

    def create(self, d: DeploymentView, avoid: frozenset[NodeId], reason: str) -> bool:
        req = PlacementRequest(
            deployment_id=d.id,
            pool=d.pool,
            gpu_class=d.profile.gpu_class,
            engine=d.profile.engine,
            requirements=d.profile.requirements,
            avoid_nodes=avoid,
        )
        result = place_replica(req, self.cap)
        if isinstance(result, Unplaceable):
            self.unplaced[d.id] = result
            return False
        self.actions.append(self._create_action(d, result, reason))
        return True

    def _create_action(self, d: DeploymentView, p: Placement, reason: str) -> CreateReplica:
        rid = self.new_id(d)
        shards = tuple(
            ShardPlacement(
                shard_id=ShardId(str(uuid.uuid5(_ID_NAMESPACE, f"{rid}/{rank}"))),
                node_id=a.node_id,
                rank=rank,
                gpu_indices=tuple(g.index for g in a.gpus),
                gpu_keys=tuple(g.key for g in a.gpus),
                hcas=a.hcas,
                fabric=a.fabric,
                leader_port=a.leader_port,
                threads=a.threads,
                desired_state="running",
            )
            for rank, a in enumerate(p.assignments)
        )
        return CreateReplica(rid, d.id, d.profile.fingerprint, shards, reason)

    # --- one deployment ---

    def deployment(self, d: DeploymentView, replicas: list[ReplicaView]) -> None:
        settings = self.snap.settings
        active = [r for r in replicas if r.state == "active"]
        c = classify(d, active, self.nodes, self.now, settings)
        # Where this deployment just crash-looped: its replacement goes elsewhere if it can.
        avoid = frozenset(
            s.node_id
            for r in replicas
            if r.state != "active" or any(r is b for b, _ in c.broken)
            for s in r.shards
            if crash_looping(s, settings)
        )
        for r, why in c.broken:
            self.retire(r, f"replacing replica: {why}", drain=False)
        if d.suspended:
            self._suspended(d, c.current, [r for r, _ in c.old])
            return
        current = list(c.current)
        if d.autoscale is not None:
            asleep = self._autoscaled(d, current)
            current = [r for r in current if r.id not in asleep]
        else:
            for r in (*c.current, *(r for r, _ in c.old)):
                if _suspended(r):
                    self.actions.append(
                        SetShardsDesiredState(r.id, "running", "deployment resumed")
                    )
        self._roll(d, current, list(c.old), avoid)

    def _autoscaled(self, d: DeploymentView, current: list[ReplicaView]) -> set[ReplicaId]:
        """Wake suspended replicas while fewer than `replicas` run, and suspend serving ones
        above it while fewer than `placed_replicas` are placed; the ids kept suspended (the
        roll leaves them be). Suspended replicas not kept go to the roll as unready surplus:
        stopped without being woken first."""
        asleep = sorted((r for r in current if _suspended(r)), key=_age)
        running = [r for r in current if not _suspended(r)]
        wake = max(0, d.replicas - len(running))
        for r in asleep[:wake]:
            self.actions.append(
                SetShardsDesiredState(r.id, "running", "autoscale: woken for demand")
            )
        asleep = asleep[wake:]
        keep = max(0, d.placed_replicas - d.replicas)
        kept = asleep[:keep]
        surplus = sorted(running, key=_removal_order)[: max(0, len(running) - d.replicas)]
        refusal = d.profile.suspend_refusal
        why = (
            f"autoscale: idle, kept placed with its engine stopped ({refusal})"
            if refusal
            else "autoscale: idle, kept placed with its engine suspended"
        )
        for r in [r for r in surplus if serving(r)][: keep - len(kept)]:
            self.actions.append(SetShardsDesiredState(r.id, "suspended", why))
            kept.append(r)
        return {r.id for r in kept}

    def _suspended(
        self, d: DeploymentView, current: tuple[ReplicaView, ...], old: list[ReplicaView]
    ) -> None:
        # Suspending keeps placement (a resume needs no free GPUs); only surplus goes.
        live = sorted((*current, *old), key=_removal_order)
        for r in live[: max(len(live) - d.replicas, 0)]:
            self.retire(r, f"scale down: {len(live)} replicas, {d.replicas} desired", drain=False)
        for r in live[max(len(live) - d.replicas, 0) :]:
            if any(s.desired_state == "running" for s in r.shards):
                self.actions.append(
                    SetShardsDesiredState(r.id, "suspended", "deployment suspended")
                )

    def _roll(
        self,
        d: DeploymentView,
        current: list[ReplicaView],
        old: list[tuple[ReplicaView, str]],
        avoid: frozenset[NodeId],
    ) -> None:
        desired = d.replicas
        budget = rollout_budget(d.max_surge, d.max_unavailable, desired)
        # Surplus current replicas: unready ones first, so availability is kept.
        current.sort(key=_removal_order)
        surplus = max(len(current) - desired, 0)
        for r in current[:surplus]:
            self.retire(r, f"scale down: {len(current)} replicas, {desired} desired", drain=True)
        current = current[surplus:]
        # Old replicas that serve nothing cost no availability: replace them first.
        for r, why in [(r, w) for r, w in old if not serving(r)]:
            self.retire(r, f"replacing unready replica: {why}", drain=False)
        old_ready = sorted(((r, w) for r, w in old if serving(r)), key=lambda o: _age(o[0]))
        num_live = len(current) + len(old_ready)
        want = desired - len(current)
        create = max(0, min(want, desired + budget.max_surge - num_live))
        created = 0
        for _ in range(create):
            reason = (
                f"rollout: surge replica for fingerprint {d.profile.fingerprint[:12]}"
                if old_ready
                else f"scale up: {num_live + created} of {desired} replicas"
            )
            if not self.create(d, avoid, reason):
                break
            created += 1
        # Old ready replicas go only while the ready count stays at or above
        # desired - max_unavailable (surge replicas count once they are ready).
        ready = sum(1 for r in current if serving(r)) + len(old_ready)
        may_lose = ready - (desired - budget.max_unavailable)
        above = max(num_live + created - desired, 0)
        n_remove = max(0, min(len(old_ready), may_lose))
        for i, (r, why) in enumerate(old_ready[:n_remove]):
            if i >= above:
                why = f"{why}; replaced in place within max_unavailable {budget.max_unavailable}"
                if d.id in self.unplaced:
                    why += f": no capacity for a surge replica ({self.unplaced[d.id].summary})"
                elif budget.max_surge == 0:
                    why += " (max_surge 0)"
            self.retire(r, f"rollout: {why}", drain=True)

    def run(self) -> list[Action]:
        by_deployment: dict[DeploymentId, list[ReplicaView]] = {}
        for r in self.snap.replicas:
            if r.state != "active":
                self.finish(r)
            if r.deployment_id is not None:
                by_deployment.setdefault(r.deployment_id, []).append(r)
        known = {d.id for d in self.snap.deployments}
        for r in self.snap.replicas:
            if r.state == "active" and (r.deployment_id is None or r.deployment_id not in known):
                self.retire(r, "deployment deleted", drain=True)
        for d in sorted(self.snap.deployments, key=lambda d: d.name):
            self.deployment(d, by_deployment.get(d.id, []))
        return self.actions


def _suspended(r: ReplicaView) -> bool:
    return any(s.desired_state == "suspended" for s in r.shards)


def _age(r: ReplicaView) -> tuple[datetime, str]:
    return (r.created_at, r.id)


def _removal_order(r: ReplicaView) -> tuple[bool, float, str]:
    """Unready before ready, then newest first (it has served least)."""
    return (serving(r), -r.created_at.timestamp(), r.id)


def compute_plan(snapshot: Snapshot, now: datetime) -> Plan:
    """The actions that move `snapshot` toward its desired state at `now`."""
    used_ids = {r.id for r in snapshot.replicas}
    actions: list[Action] = []
    snap = snapshot
    unplaced: dict[DeploymentId, Unplaceable] = {}
    nodes = {n.id: n for n in snapshot.nodes}
    for _ in range(_MAX_ROUNDS):
        rnd = _Round(snap, now, nodes, used_ids)
        step = rnd.run()
        unplaced = rnd.unplaced
        if not step:
            break
        actions.extend(step)
        snap = apply_actions(snap, tuple(step), now)
    actions.extend(status_actions(snapshot, snap, now, unplaced))
    names = {d.id: d.name for d in snapshot.deployments}
    return Plan(
        now=now,
        actions=tuple(actions),
        unplaced=tuple(sorted((names[k], v.explain()) for k, v in unplaced.items())),
    )
