"""The adapter placement's pass over a snapshot (``planner.adapter_pass``), pure: what it reads
of replicas (readiness, the slots they were launched with, what they hold), what it writes
(rank-0 shards whose desired adapters change, nothing once applied), what it records (a load
or unload once, not every pass until the agent acts) and the reasons that name the fix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest

from llmgw.planner.adapter_pass import (
    AdapterPass,
    DeclaredAdapter,
    Holder,
    ObservedAdapter,
    PlacedAdapter,
    Served,
    adapter_demand,
    adapter_pass,
    parse_desired,
    parse_observed,
    readiness,
)
from llmgw.planner.adapter_placement import AdapterDemand, AdapterSpec, AdapterState
from llmgw.planner.snapshot import (
    DeploymentId,
    NodeId,
    ReplicaId,
    ReplicaView,
    ShardId,
    ShardView,
    Snapshot,
)
from tests.planner.planner_testkit import T0, deployment, node, snapshot

_SQL = DeclaredAdapter(AdapterSpec("sql", "m"), "/adapters/sql")


def _replica(
    rid: str, dep: str, *, ready: bool = True, state: str = "active", ranks: int = 1
) -> ReplicaView:
    shards = tuple(
        ShardView(
            id=ShardId(f"{rid}-s{rank}"),
            replica_id=ReplicaId(rid),
            node_id=NodeId(f"n-{rid}-{rank}"),
            rank=rank,
            observed_state="ready" if ready else "starting",
        )
        for rank in range(ranks)
    )
    return ReplicaView(
        id=ReplicaId(rid),
        deployment_id=DeploymentId(dep) if dep else None,
        profile_fingerprint="fp-1",
        created_at=T0,
        shards=shards,
        state=state,  # type: ignore[arg-type]
    )


def _world(
    replicas: Sequence[ReplicaView],
    *,
    slots: Mapping[str, int] | None = None,
    profile_slots: int = 2,
) -> tuple[Snapshot, dict[ShardId, Holder], dict[DeploymentId, Served]]:
    """Deployment ``d`` (model m, profile p) and ``plain`` (model m, profile q, no slots)."""
    snap = snapshot(
        [deployment("d"), deployment("plain")],
        [node(f"n-{r.id}-0") for r in replicas],
        replicas,
    )
    # Launched with the profile's slots unless ``slots`` says otherwise (an edit not rolled).
    holders = {
        ShardId(f"{r.id}-s0"): Holder(
            slots=(slots or {}).get(r.id, profile_slots if r.deployment_id == "d" else 0)
        )
        for r in replicas
    }
    served = {
        DeploymentId("d"): Served("m", "p", profile_slots),
        DeploymentId("plain"): Served("m", "q", 0),
    }
    return snap, holders, served


def _pass(
    snap: Snapshot,
    holders: Mapping[ShardId, Holder],
    served: Mapping[DeploymentId, Served],
    *,
    adapters: Sequence[DeclaredAdapter] = (_SQL,),
    demand: Mapping[str, AdapterDemand] | None = None,
    states: Mapping[str, AdapterState] | None = None,
    now: float = 1000.0,
) -> AdapterPass:
    return adapter_pass(
        snap,
        adapters=adapters,
        holders=holders,
        served=served,
        demand=demand if demand is not None else {"sql": AdapterDemand(gateways=1, waiting=1)},
        states=states or {},
        now=now,
    )


def _applied(holders: Mapping[ShardId, Holder], p: AdapterPass) -> dict[ShardId, Holder]:
    """The holders once the pass's writes are stored (the agents not yet acting)."""
    out = dict(holders)
    for w in p.writes:
        out[w.shard_id] = replace(out[w.shard_id], desired=w.adapters)
    return out


def test_readiness_reads_replica_and_shard_states() -> None:
    assert readiness(_replica("a", "d")) == "ready"
    assert readiness(_replica("a", "d", ready=False)) == "starting"
    assert readiness(_replica("a", "d", state="draining")) == "draining"
    assert readiness(_replica("a", "d", state="stopping")) == "draining"
    suspended = _replica("a", "d")
    suspended = replace(
        suspended, shards=tuple(replace(s, desired_state="suspended") for s in suspended.shards)
    )
    assert readiness(suspended) == "starting"


def test_a_held_request_places_on_a_ready_replica_with_slots_and_applied_is_a_no_op() -> None:
    snap, holders, served = _world(
        [_replica("a", "d"), _replica("b", "d", ready=False), _replica("c", "plain")]
    )
    p = _pass(snap, holders, served)
    assert [(w.replica_id, w.adapters) for w in p.writes] == [
        ("a", (PlacedAdapter("sql", "/adapters/sql"),))
    ]
    assert [w.shard_id for w in p.writes] == ["a-s0"] and p.writes[0].node_id == "n-a-0"
    assert [(c.kind, c.replica_id) for c in p.changes] == [("scale", None), ("load", "a")]
    assert p.counts() == {"AdapterScale": 1, "AdapterLoad": 1}
    assert p.status["sql"].desired_replicas == 1 and p.status["sql"].unplaced == ""
    # Written and planned again (the agent has not reported yet): nothing to write or record.
    again = _pass(snap, _applied(holders, p), served, states=p.states, now=1002.0)
    assert again.writes == () and again.changes == ()


def test_slots_are_the_launched_engines_not_the_profiles() -> None:
    # The profile now has slots, but its replica was started without: nothing goes there,
    # and the reason is the replicas', not the profile's (the roll brings the slots).
    snap, holders, served = _world([_replica("a", "d")], slots={"a": 0})
    p = _pass(snap, holders, served)
    assert p.writes == ()
    assert p.status["sql"].unplaced == "the 1 replicas of model m have no adapter slots"


def test_an_unload_is_recorded_once_and_a_failed_load_stays_put() -> None:
    snap, holders, served = _world([_replica("a", "d"), _replica("b", "d")])
    placed = (PlacedAdapter("sql", "/adapters/sql"),)
    # Held on a, told to b as well earlier, but b's load failed: it stays desired on b (its
    # agent retries), it does not move to another replica every pass.
    holders[ShardId("a-s0")] = Holder(
        2, desired=placed, observed=(ObservedAdapter("sql", "loaded"),)
    )
    holders[ShardId("b-s0")] = Holder(
        2, desired=placed, observed=(ObservedAdapter("sql", "failed", "boom", 3),)
    )
    busy = {"sql": AdapterDemand(gateways=1, requests_per_s=12.0)}
    p = _pass(snap, holders, served, demand=busy)
    assert p.writes == () and p.changes == ()
    # The adapter is deleted: unloaded from both, recorded once each.
    gone = _pass(snap, holders, served, adapters=(), demand={}, states=p.states)
    assert sorted((w.replica_id, w.adapters) for w in gone.writes) == [("a", ()), ("b", ())]
    assert sorted((c.kind, c.replica_id) for c in gone.changes) == [
        ("unload", "a"),
        ("unload", "b"),
    ]
    assert all("no longer declared" in c.reason for c in gone.changes)
    # Stored, but a's agent still reports it loaded: the same unload, not recorded again.
    later = _pass(snap, _applied(holders, gone), served, adapters=(), demand={}, states=gone.states)
    assert later.writes == () and later.changes == ()


def test_path_and_pinned_changes_are_rewritten_without_a_load() -> None:
    snap, holders, served = _world([_replica("a", "d")])
    holders[ShardId("a-s0")] = Holder(2, desired=(PlacedAdapter("sql", "/old"),))
    pinned = DeclaredAdapter(AdapterSpec("sql", "m", pinned=True), "/adapters/sql")
    p = _pass(snap, holders, served, adapters=(pinned,))
    assert [w.adapters for w in p.writes] == [(PlacedAdapter("sql", "/adapters/sql", True),)]
    assert [c.kind for c in p.changes] == []


def test_replicas_of_a_deleted_deployment_and_other_ranks_take_no_part() -> None:
    orphan = _replica("o", "")
    two_nodes = _replica("t", "d", ranks=2)
    snap, holders, served = _world([orphan, two_nodes])
    holders[ShardId("o-s0")] = Holder(2, desired=(PlacedAdapter("sql", "/adapters/sql"),))
    p = _pass(snap, holders, served)
    assert [w.shard_id for w in p.writes] == ["t-s0"]


@pytest.mark.parametrize(
    ("profile_slots", "deployments", "reason"),
    [
        (
            0,
            True,
            "no profile of model m holds adapters at runtime: set adapter_slots on profile p or "
            "q (vLLM, SGLang and the simulator load adapters at runtime) or list it in the "
            "profile's adapters",
        ),
        (
            2,
            False,
            "model m has no deployment: deploy it with a profile that sets adapter_slots (vLLM, "
            "SGLang and the simulator load adapters at runtime)",
        ),
    ],
)
def test_an_adapter_no_replica_can_ever_hold_names_the_fix(
    profile_slots: int, deployments: bool, reason: str
) -> None:
    snap, holders, served = _world([_replica("a", "d")], profile_slots=profile_slots)
    if not deployments:
        snap = replace(snap, deployments=(), replicas=())
        served = {}
    # With no demand at all too: the operator learns it before the first request fails.
    for demand in ({"sql": AdapterDemand(gateways=1, waiting=1)}, {}):
        p = _pass(snap, holders, served, demand=demand)
        assert p.status["sql"] == type(p.status["sql"])(0, reason)
        assert p.writes == ()


def test_unreported_demand_is_idle_when_a_gateway_reports_and_unknown_when_none_does() -> None:
    busy = AdapterDemand(gateways=2, requests_per_s=3.0)
    assert adapter_demand(["a", "b"], {"a": busy}, fresh_gateways=2) == {
        "a": busy,
        "b": AdapterDemand(gateways=2),
    }
    unknown = adapter_demand(["b"], {}, fresh_gateways=0)["b"]
    assert not unknown.known


def test_stored_arrays_parse_leniently() -> None:
    text = (
        '[{"name": "a", "path": "/a", "pinned": true}, {"name": 3}, "x", '
        '{"name": "b", "path": "/b"}]'
    )
    assert parse_desired(text) == (PlacedAdapter("a", "/a", True), PlacedAdapter("b", "/b"))
    assert parse_desired("[]") == () and parse_desired(None) == () and parse_desired("{") == ()
    observed = (
        '[{"name": "a", "state": "failed", "reason": "r", "failures": 2}, '
        '{"name": "b", "state": "evicting"}, {"name": "c", "state": "loaded", "failures": true}]'
    )
    assert parse_observed(observed) == (
        ObservedAdapter("a", "failed", "r", 2),
        ObservedAdapter("c", "loaded"),
    )


def test_an_adapter_moved_off_a_full_replica_is_gone_there_at_once() -> None:
    # r1 (2 slots) was told {a, c} after holding {a, b}; b was moved to r2. r1's agent still
    # reports b loaded (its unload is not done) and r2's has not reported b yet: the next pass
    # must change nothing, neither unloading a or c from r1 for want of a slot nor moving b
    # back. (Counting the reports as held did both: bench/adapters.py's churn.)
    a, b, c = (DeclaredAdapter(AdapterSpec(n, "m"), f"/adapters/{n}") for n in "abc")
    snap, holders, served = _world([_replica("r1", "d"), _replica("r2", "d")])
    placed = {n: PlacedAdapter(n, f"/adapters/{n}") for n in "abc"}
    holders[ShardId("r1-s0")] = Holder(
        slots=2,
        desired=(placed["a"], placed["c"]),
        observed=(ObservedAdapter("a", "loaded"), ObservedAdapter("b", "loaded")),
    )
    holders[ShardId("r2-s0")] = Holder(slots=2, desired=(placed["b"],))
    busy = AdapterDemand(gateways=1, waiting=1)
    states = {n: AdapterState(desired=1) for n in "abc"}
    p = _pass(
        snap,
        holders,
        served,
        adapters=(a, b, c),
        demand={n: busy for n in "abc"},
        states=states,
    )
    assert not p.writes, p.writes
    assert not [ch for ch in p.changes if ch.kind in ("load", "unload")], p.changes
