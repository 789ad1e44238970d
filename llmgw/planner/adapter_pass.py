"""The adapter placement's pass over a snapshot: which runtime LoRA adapters each replica's
engine should hold, the status of every declared adapter, and the changes to record.

Issue [lora] "Adapters at runtime". The leader calls ``adapter_pass`` once per reconcile pass,
beside the plan: the declared adapters (``kind: adapter``), the snapshot's replicas with what
their rank-0 shard was told and reports (``Holder``), the base models' deployments
(``Served``), each adapter's demand and the states the last call returned go in; what comes
out is the rank-0 shards whose ``desired_adapters`` change (what the agent loads and unloads
at runtime), every declared adapter's status, the next call's states and the changes worth a
line of the action record. The choice itself is ``adapter_placement.plan_adapters``'s; the
rules of reading the fleet for it are here:

- a replica is ``ready`` while it is active and serving (every shard desired running and
  reported ready), ``draining`` once it drains or stops, else ``starting`` (placed, loading,
  unhealthy, or suspended by the autoscaler: its engine takes no load while asleep);
- its slots are the ``adapter_slots`` its engine was started with (the launch spec's profile),
  not the profile's current value: a profile edit rolls the replicas (the engine's flags are in
  the fingerprint), and an adapter sent to an engine started without them would only fail;
- it holds what it was told to hold (``desired_adapters``, the leader's last decision, kept
  in the database so a new leader reads it too), not what its agent reports: a load asked for
  and not reported yet counts as held, so it is not started again elsewhere; a failed one
  stays where it was placed (its agent retries with backoff; the failure is in the status)
  instead of moving every pass; and an adapter dropped from the set is gone at once, though
  its agent still reports it until its unload is done. Counting the agent's report as well
  made a replica look over its slots after every swap (the dropped adapter still reported
  beside its replacement), so the placement unloaded another holder or put the dropped one
  back: bench/adapters.py measured 43 such needless unloads in 150 s;
- a load or unload is recorded only when it changes what a shard is told: an unload its agent
  has not done yet is the same decision, not a new one every pass;
- an adapter that no replica of its base model can ever hold says what fixes it (a profile's
  ``adapter_slots``, or a static ``adapters`` entry), not only that slots are missing.

This module must NOT do I/O or read a clock: the shell passes ``now`` and every input.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from llmgw.planner.adapter_placement import (
    AdapterChange,
    AdapterDemand,
    AdapterPlacementConfig,
    AdapterSpec,
    AdapterState,
    BaseReplica,
    Readiness,
    plan_adapters,
)
from llmgw.planner.replicas import serving
from llmgw.planner.snapshot import DeploymentId, NodeId, ReplicaId, ReplicaView, ShardId, Snapshot

__all__ = [
    "RUNTIME_ENGINES_TEXT",
    "AdapterPass",
    "AdapterStatus",
    "DeclaredAdapter",
    "Holder",
    "ObservedAdapter",
    "ObservedAdapterState",
    "PlacedAdapter",
    "Served",
    "ShardAdapters",
    "action_name",
    "adapter_demand",
    "adapter_pass",
    "parse_desired",
    "parse_observed",
    "readiness",
]

# Who loads adapters at runtime, for the reasons that name the fix (Engine.validate refuses
# adapter_slots above 0 for the others).
RUNTIME_ENGINES_TEXT = "vLLM, SGLang and the simulator load adapters at runtime"

ObservedAdapterState = Literal["loading", "loaded", "failed", "unloading"]
_OBSERVED_STATES: dict[object, ObservedAdapterState] = {
    "loading": "loading", "loaded": "loaded", "failed": "failed", "unloading": "unloading",
}  # fmt: skip
_DEFAULT_CONFIG = AdapterPlacementConfig()


@dataclass(frozen=True, slots=True)
class DeclaredAdapter:
    """A ``kind: adapter`` declaration: the placement's spec and where nodes find it."""

    spec: AdapterSpec
    path: str

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True, slots=True)
class PlacedAdapter:
    """One entry of a shard's ``desired_adapters`` (protocol.RuntimeAdapter's fields)."""

    name: str
    path: str
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class ObservedAdapter:
    """One entry of a shard's ``observed_adapters`` (protocol.AdapterObserved's fields)."""

    name: str
    state: ObservedAdapterState
    reason: str = ""
    # Failed loads in a row, as the agent counts them for its backoff.
    failures: int = 0


@dataclass(frozen=True, slots=True)
class Holder:
    """A replica's rank-0 shard as the placement reads it (only rank 0 serves HTTP, so only
    its engine loads adapters)."""

    # The adapter_slots the engine was launched with (its launch spec's profile).
    slots: int
    # What the shard is told to hold (shards.desired_adapters), by name.
    desired: tuple[PlacedAdapter, ...] = ()
    # What its agent last reported (shards.observed_adapters).
    observed: tuple[ObservedAdapter, ...] = ()


@dataclass(frozen=True, slots=True)
class Served:
    """What a deployment serves, for adapters: its model's name (what an adapter's ``model``
    names) and its profile's current ``adapter_slots`` (0 for a profile that cannot launch)."""

    model: str
    profile: str
    adapter_slots: int


@dataclass(frozen=True, slots=True)
class ShardAdapters:
    """A rank-0 shard's new desired adapters (in name order), and whose node's set changes."""

    shard_id: ShardId
    replica_id: ReplicaId
    node_id: NodeId
    adapters: tuple[PlacedAdapter, ...]


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    """What the status of a declared adapter keeps of this pass (``adapter_status``)."""

    desired_replicas: int
    # Why it has fewer holders than desired, or none at all, with what fixes it; "": it has.
    unplaced: str = ""


@dataclass(frozen=True, slots=True)
class AdapterPass:
    # The next call's states, for the leader to keep (plan_adapters'; a deleted adapter is gone).
    states: Mapping[str, AdapterState]
    # Rank-0 shards whose desired adapters differ from what they are told, by shard id.
    writes: tuple[ShardAdapters, ...]
    # Every declared adapter, by name.
    status: Mapping[str, AdapterStatus]
    # Count changes, then unloads, then loads, each one that changes what a shard is told.
    changes: tuple[AdapterChange, ...] = field(default=())

    def counts(self) -> dict[str, int]:
        """Recorded changes by action name (``AdapterScale``, ``AdapterUnload``, ...)."""
        return dict(Counter(action_name(c) for c in self.changes))


def action_name(change: AdapterChange) -> str:
    """The ``reconcile_actions.action`` a change is recorded under."""
    return {"scale": "AdapterScale", "load": "AdapterLoad", "unload": "AdapterUnload"}[change.kind]


def readiness(r: ReplicaView) -> Readiness:
    """What the placement may do with a replica (see the module docstring)."""
    if r.state != "active":
        return "draining"
    return "ready" if serving(r) else "starting"


def parse_desired(text: str | None) -> tuple[PlacedAdapter, ...]:
    """A shard's ``desired_adapters`` as stored (JSON text); entries it cannot read are
    skipped (the leader rewrites them on this pass)."""
    out: list[PlacedAdapter] = []
    for item in _items(text):
        name, path = item.get("name"), item.get("path")
        if isinstance(name, str) and isinstance(path, str):
            out.append(PlacedAdapter(name, path, item.get("pinned") is True))
    return tuple(out)


def parse_observed(text: str | None) -> tuple[ObservedAdapter, ...]:
    """A shard's ``observed_adapters`` as stored (JSON text); entries in a state this
    release does not know are skipped (a newer agent's)."""
    out: list[ObservedAdapter] = []
    for item in _items(text):
        name, state = item.get("name"), _OBSERVED_STATES.get(item.get("state"))
        if not isinstance(name, str) or state is None:
            continue
        reason, failures = item.get("reason"), item.get("failures")
        out.append(
            ObservedAdapter(
                name,
                state,
                reason if isinstance(reason, str) else "",
                failures if isinstance(failures, int) and not isinstance(failures, bool) else 0,
            )
        )
    return tuple(out)


def _items(text: str | None) -> list[dict[str, object]]:
    # "[]" is nearly every shard's value: not worth a parse per shard per pass.
    if not text or text == "[]":
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def adapter_demand(
    names: Sequence[str], reported: Mapping[str, AdapterDemand], *, fresh_gateways: int
) -> dict[str, AdapterDemand]:
    """Every adapter's demand: what the gateways reported under its name, and for one they did
    not report, none at all when some gateway's report is fresh (gateways report every name
    they route, as the autoscaler reads them) or unknown when none is."""
    idle = AdapterDemand(gateways=fresh_gateways)
    return {n: reported.get(n, idle) for n in names}


def _no_runtime_profile(model: str, profiles: Mapping[str, int]) -> str:
    """Why no replica of ``model`` can ever hold an adapter, naming the fix; "" when one can."""
    if not profiles:
        return (
            f"model {model} has no deployment: deploy it with a profile that sets "
            f"adapter_slots ({RUNTIME_ENGINES_TEXT})"
        )
    if any(slots > 0 for slots in profiles.values()):
        return ""
    names = " or ".join(sorted(profiles))
    return (
        f"no profile of model {model} holds adapters at runtime: set adapter_slots on "
        f"profile {names} ({RUNTIME_ENGINES_TEXT}) or list it in the profile's adapters"
    )


def adapter_pass(
    snapshot: Snapshot,
    *,
    adapters: Sequence[DeclaredAdapter],
    holders: Mapping[ShardId, Holder],
    served: Mapping[DeploymentId, Served],
    demand: Mapping[str, AdapterDemand],
    states: Mapping[str, AdapterState],
    now: float,
    config: AdapterPlacementConfig = _DEFAULT_CONFIG,
) -> AdapterPass:
    """The adapters' placement at ``now`` (seconds on the clock ``states`` were written with).

    ``holders``: the rank-0 shards not released, by shard id. ``served``: every deployment of
    the snapshot. Replicas of a deleted deployment take no part: they are leaving, and what
    their shard was told stays as it is."""
    declared = {a.name: a for a in adapters}
    replicas: list[BaseReplica] = []
    shard_of: dict[ReplicaId, tuple[ShardId, NodeId, Holder]] = {}
    for r in snapshot.replicas:
        dep = served.get(r.deployment_id) if r.deployment_id is not None else None
        rank0 = next((s for s in r.shards if s.rank == 0 and not s.released), None)
        holder = None if rank0 is None else holders.get(rank0.id)
        if dep is None or rank0 is None or holder is None:
            continue
        held = {a.name for a in holder.desired}
        replicas.append(
            BaseReplica(
                replica_id=r.id,
                model=dep.model,
                slots=max(holder.slots, 0),
                readiness=readiness(r),
                loaded=frozenset(held),
            )
        )
        shard_of[r.id] = (rank0.id, rank0.node_id, holder)

    plan = plan_adapters(
        [a.spec for a in adapters], replicas, demand=demand, states=states, now=now, config=config
    )

    writes: list[ShardAdapters] = []
    told: dict[ReplicaId, frozenset[str]] = {}
    for rid, want in plan.desired_sets.items():
        shard_id, node_id, holder = shard_of[rid]
        told[rid] = frozenset(a.name for a in holder.desired)
        new = tuple(
            PlacedAdapter(n, declared[n].path, declared[n].spec.pinned) for n in sorted(want)
        )
        if new != holder.desired:
            writes.append(ShardAdapters(shard_id, rid, node_id, new))

    changes = tuple(
        c
        for c in plan.changes
        if c.replica_id is None
        or (c.kind == "load") != (c.adapter in told.get(c.replica_id, frozenset()))
    )

    profiles: dict[str, dict[str, int]] = {}
    for d in snapshot.deployments:
        s = served.get(d.id)
        if s is not None:
            by_profile = profiles.setdefault(s.model, {})
            by_profile[s.profile] = max(by_profile.get(s.profile, 0), s.adapter_slots)
    status: dict[str, AdapterStatus] = {}
    for name, outcome in plan.adapters.items():
        fix = _no_runtime_profile(outcome.model, profiles.get(outcome.model, {}))
        status[name] = AdapterStatus(outcome.desired, fix or outcome.unplaced)
    return AdapterPass(
        states=plan.states,
        writes=tuple(sorted(writes, key=lambda w: w.shard_id)),
        status=status,
        changes=changes,
    )
