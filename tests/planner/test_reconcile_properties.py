"""Properties of compute_plan over generated fleets, edits and failures (hypothesis).

- safety: never a GPU twice (a MIG instance and its parent count as one), never
  one that does not exist, never a leader port twice on a node, never a
  multi-node replica across fabrics or GPU models, TRT-LLM ranks on the same
  indices;
- idempotence: planning again on the applied plan yields no actions;
- availability: a rollout never takes ready replicas below desired - max_unavailable;
- convergence: with room for the fleet, reconcile + agents reach the desired state.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.planner import (
    DeploymentView,
    NodeView,
    PlanSettings,
    Snapshot,
    apply_to_snapshot,
    compute_plan,
    rollout_budget,
    serving,
)
from tests.planner.planner_testkit import (
    SETTINGS,
    T0,
    agents_step,
    deployment,
    node,
    profile,
    ready_count,
    run_until_settled,
    snapshot,
)

PATTERNS = PlanSettings(
    sync_period_s=2.0,
    sync_grace_s=10.0,
    drain_timeout_s=15.0,
    crash_loop_restarts=3,
    leader_port_min=29500,
    leader_port_max=29509,
    # "hopper" matches two GPU models: what the uniformity rule is for.
    gpu_class_patterns=(("h100", "H100"), ("h200", "H200"), ("hopper", "H[12]00")),
)
BUDGETS = [("1", "0"), ("0", "1"), ("1", "1"), ("25%", "25%"), ("2", "0"), ("0", "50%")]
DT = timedelta(seconds=5)
PROPS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@st.composite
def _nodes(draw: st.DrawFn) -> list[NodeView]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        mig = draw(st.sampled_from([None, {0: 2}, {1: 3}]))
        gpus = draw(st.sampled_from([2, 4, 8, 8]))
        out.append(
            node(
                f"n{i}",
                gpus,
                gpu_name=draw(st.sampled_from(["NVIDIA H100 80GB HBM3", "NVIDIA H200"])),
                fabrics=draw(
                    st.sampled_from([(), ("ib0",), ("ib1",), ("nvl:r1",), ("ib0", "nvl:r1")])
                ),
                mig=mig if mig and max(mig) < gpus else None,
                cordoned=draw(st.booleans()) and draw(st.booleans()),
            )
        )
    return out


@st.composite
def _deployments(draw: st.DrawFn) -> list[DeploymentView]:
    out = []
    for i in range(draw(st.integers(1, 3))):
        nodes = draw(st.sampled_from([1, 1, 2]))
        gpus = draw(st.sampled_from([4, 8] if nodes > 1 else [1, 2, 4, 8]))
        surge, unavailable = draw(st.sampled_from(BUDGETS))
        prof = profile(
            "fp-1",
            gpus=gpus,
            nodes=nodes,
            gpu_class=draw(st.sampled_from(["h100", "h200", "hopper"])),
            uniform=nodes > 1 and draw(st.booleans()),
        )
        out.append(
            deployment(
                f"d{i}",
                draw(st.integers(0, 3)),
                prof,
                max_surge=surge,
                max_unavailable=unavailable,
                progress_deadline_s=60,
            )
        )
    return out


# An event between reconcile passes: (kind, index).
_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(
            ["none", "none", "roll", "scale", "cordon", "drain", "kill", "crash", "suspend"]
        ),
        st.integers(0, 5),
    ),
    min_size=4,
    max_size=14,
)


def _apply_event(snap: Snapshot, kind: str, i: int, dead: set[str]) -> Snapshot:
    ds = list(snap.deployments)
    d = ds[i % len(ds)]
    if kind == "roll":
        fp = f"fp-{d.generation + 1}"
        ds[i % len(ds)] = replace(
            d, profile=replace(d.profile, fingerprint=fp), generation=d.generation + 1
        )
    elif kind == "scale":
        ds[i % len(ds)] = replace(d, replicas=(d.replicas + i) % 4, generation=d.generation + 1)
    elif kind == "suspend":
        ds[i % len(ds)] = replace(d, suspended=not d.suspended, generation=d.generation + 1)
    elif kind in ("cordon", "drain"):
        n = snap.nodes[i % len(snap.nodes)]
        flagged = replace(n, cordoned=True) if kind == "cordon" else replace(n, draining=True)
        return replace(snap, nodes=tuple(flagged if x.id == n.id else x for x in snap.nodes))
    elif kind == "kill":
        dead.add(snap.nodes[i % len(snap.nodes)].name)
    elif kind == "crash" and snap.replicas:
        r = snap.replicas[i % len(snap.replicas)]
        shards = tuple(replace(s, restarts=s.restarts + 3) for s in r.shards)
        return replace(
            snap,
            replicas=tuple(replace(r, shards=shards) if x.id == r.id else x for x in snap.replicas),
        )
    return replace(snap, deployments=tuple(ds))


def _check_safety(snap: Snapshot) -> None:
    nodes = {n.id: n for n in snap.nodes}
    deployments = {d.id: d for d in snap.deployments}
    held: dict[str, set[str]] = {}
    ports: dict[str, set[int]] = {}
    for r in snap.replicas:
        live = [s for s in r.shards if not s.released]
        for s in live:
            n = nodes[s.node_id]
            gpus = {g.key: g for g in n.gpus}
            mine = held.setdefault(s.node_id, set())
            for key in s.gpu_keys:
                assert key in gpus, f"{key} does not exist on {n.name}"
                assert key not in mine, f"{key} on {n.name} given twice"
                mine.add(key)
            if s.leader_port is not None:
                assert s.leader_port not in ports.setdefault(s.node_id, set())
                ports[s.node_id].add(s.leader_port)
        if len(r.shards) > 1:
            fabrics = {s.fabric for s in r.shards}
            assert len(fabrics) == 1 and "" not in fabrics, f"replica {r.id} spans {fabrics}"
            (fabric,) = fabrics
            assert all(any(f.name == fabric for f in nodes[s.node_id].fabrics) for s in r.shards)
            names = {g.name for s in r.shards for g in nodes[s.node_id].gpus if g.key in s.gpu_keys}
            assert len(names) == 1, f"replica {r.id} mixes {names}"
            d = deployments.get(r.deployment_id) if r.deployment_id else None
            if (
                d is not None
                and d.profile.fingerprint == r.profile_fingerprint
                and d.profile.requirements.same_gpu_indices_across_nodes
            ):
                assert len({s.gpu_indices for s in r.shards}) == 1
    for node_id, keys in held.items():
        n = nodes[node_id]
        for g in n.gpus:
            if g.mig and g.key in keys:
                assert str(g.mig_parent) not in keys, (
                    f"MIG {g.key} and its parent both used on {n.name}"
                )


@PROPS
@given(nodes=_nodes(), deployments=_deployments(), events=_EVENTS)
def test_plans_are_safe_and_idempotent_under_edits_and_failures(
    nodes: list[NodeView], deployments: list[DeploymentView], events: list[tuple[str, int]]
) -> None:
    snap = snapshot(deployments, nodes, settings=PATTERNS)
    now = T0
    dead: set[str] = set()
    for kind, i in [("none", 0), ("none", 0), *events, *[("none", 0)] * 6]:
        snap = _apply_event(snap, kind, i, dead)
        plan = compute_plan(snap, now)
        snap = apply_to_snapshot(snap, plan, now)
        _check_safety(snap)
        again = compute_plan(snap, now)
        assert again.actions == (), again.actions
        now += DT
        snap = agents_step(snap, now, dead=frozenset(dead))


def _roomy_fleet(deployments: list[DeploymentView]) -> list[NodeView]:
    # One node per replica shard plus a spare replica's worth: always room, even for a surge.
    need = sum(d.replicas * d.profile.requirements.nodes for d in deployments)
    need += max(d.profile.requirements.nodes for d in deployments)
    return [node(f"n{i}", 8, fabrics=["ib0"]) for i in range(need)]


@st.composite
def _h100_deployments(draw: st.DrawFn) -> list[DeploymentView]:
    return [
        replace(
            d,
            profile=replace(
                d.profile, requirements=replace(d.profile.requirements, gpu_class="h100")
            ),
        )
        for d in draw(_deployments())
    ]


def _roll_all(snap: Snapshot, fingerprint: str) -> Snapshot:
    return replace(
        snap,
        deployments=tuple(
            replace(
                d, profile=replace(d.profile, fingerprint=fingerprint), generation=d.generation + 1
            )
            for d in snap.deployments
        ),
    )


def _full_fleet(d: DeploymentView) -> list[NodeView]:
    # Exactly the GPUs the replicas hold, none spare: a surge can never be placed,
    # so the rollout must go in place (the budget is made to allow one unavailable).
    req = d.profile.requirements
    return [
        node(f"n{i}", req.gpus_per_node, fabrics=["ib0"]) for i in range(d.replicas * req.nodes)
    ]


@PROPS
@given(deployments=_h100_deployments(), reroll_at=st.integers(0, 12), full=st.booleans())
def test_rollouts_keep_availability_and_converge(
    deployments: list[DeploymentView], reroll_at: int, full: bool
) -> None:
    if full:
        d = deployments[0]
        if rollout_budget(d.max_surge, d.max_unavailable, d.replicas).max_unavailable == 0:
            d = replace(d, max_unavailable="1")
        deployments = [d]
        snap = snapshot(deployments, _full_fleet(d), settings=PATTERNS)
    else:
        snap = snapshot(deployments, _roomy_fleet(deployments), settings=PATTERNS)
    snap, now, _ = run_until_settled(snap, T0)
    # Roll every deployment at once, the worst case for availability, and roll
    # again mid-way (an edit during a rollout).
    snap = _roll_all(snap, "fp-new")
    floors = {
        d.name: d.replicas
        - rollout_budget(d.max_surge, d.max_unavailable, d.replicas).max_unavailable
        for d in snap.deployments
    }
    target = "fp-new"
    for k in range(100):
        if k == reroll_at:
            snap, target = _roll_all(snap, "fp-newer"), "fp-newer"
        before = {name: ready_count(snap, name) for name in floors}
        plan = compute_plan(snap, now)
        snap = apply_to_snapshot(snap, plan, now)
        for name, floor in floors.items():
            if before[name] >= floor:
                assert ready_count(snap, name) >= floor, (name, plan.actions)
        now += DT
        moved = agents_step(snap, now)
        settled = (
            k > reroll_at
            and not plan.actions
            and moved.replicas == snap.replicas
            and not any(r.state == "draining" for r in snap.replicas)
        )
        snap = moved
        if settled:
            break
    else:
        raise AssertionError("rollout did not converge in 100 passes")
    for d in snap.deployments:
        mine = [r for r in snap.replicas if r.deployment_id == d.id]
        assert len(mine) == d.replicas
        assert all(r.profile_fingerprint == target and serving(r) for r in mine)
        assert d.status.reason == f"complete: {d.replicas} of {d.replicas} replicas ready"


def test_default_settings_are_consistent() -> None:
    assert SETTINGS.sync_grace_s >= 5 * SETTINGS.sync_period_s
