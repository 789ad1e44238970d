"""The supervisor's pure core: world in, actions out (tables), and properties (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.nodeagent.diff import (
    DesiredView,
    Plan,
    RunningView,
    compute_plan,
    max_stops,
)


def D(sid: str, digest: str = "d1", **kw: object) -> DesiredView:
    return DesiredView(shard_id=sid, digest=digest, **kw)  # type: ignore[arg-type]


def R(sid: str, digest: str = "d1", phase: str = "live", **kw: object) -> RunningView:
    return RunningView(shard_id=sid, digest=digest, phase=phase, **kw)  # type: ignore[arg-type]


def kinds(plan: Plan) -> dict[str, list[str]]:
    return plan.kinds()


@pytest.mark.parametrize(
    ("desired", "running", "expected"),
    [
        ([D("a")], [], {"start": ["a"]}),
        ([D("a")], [R("a")], {}),
        ([D("a", "d2")], [R("a")], {"replace": ["a"]}),
        ([D("a")], [R("a", phase="unadopted")], {"adopt": ["a"]}),
        ([D("a", "d2")], [R("a", phase="unadopted")], {"replace": ["a"]}),
        ([], [R("a")], {"stop": ["a"]}),
        ([], [R("a", phase="exited")], {"forget": ["a"]}),
        ([], [R("a", phase="stopping")], {}),
        ([D("a")], [R("a", phase="stopping")], {}),
        ([D("a", state="stopped")], [R("a")], {"stop": ["a"]}),
        ([D("a", state="suspended", suspendable=True)], [R("a")], {"suspend": ["a"]}),
        ([D("a", state="suspended")], [R("a")], {"stop": ["a"]}),
        ([D("a")], [R("a", suspended=True)], {"resume": ["a"]}),
        # Exited: restart only once the backoff passed, at once for a new spec.
        ([D("a")], [R("a", phase="exited", restart_at=5.0)], {}),
        ([D("a")], [R("a", phase="exited", restart_at=1.0)], {"start": ["a"]}),
        ([D("a", "d2")], [R("a", phase="exited", restart_at=5.0)], {"start": ["a"]}),
        # An unlaunchable spec never touches what runs, and is never started.
        ([D("a", "d2", launchable=False)], [R("a")], {}),
        ([D("a", launchable=False)], [], {}),
        ([D("a", "d2", launchable=False)], [R("a", phase="unadopted")], {"adopt": ["a"]}),
    ],
)
def test_table(
    desired: list[DesiredView], running: list[RunningView], expected: dict[str, list[str]]
) -> None:
    plan = compute_plan({d.shard_id: d for d in desired}, {r.shard_id: r for r in running}, now=2.0)
    assert kinds(plan) == expected


def test_the_half_rule_holds_mass_stops_unless_a_drain_is_confirmed() -> None:
    running = {s: R(s) for s in "abcd"}
    plan = compute_plan({}, running, now=0)
    assert plan.actions == () and set(plan.held_stops) == set("abcd")
    # Two of four is half: allowed.
    plan = compute_plan({"a": D("a"), "b": D("b")}, running, now=0)
    assert kinds(plan) == {"stop": ["c", "d"]} and plan.held_stops == ()
    plan = compute_plan({}, running, now=0, confirmed_drain=True)
    assert kinds(plan) == {"stop": list("abcd")}
    # A node with one shard can still give it up.
    assert kinds(compute_plan({}, {"a": R("a")}, now=0)) == {"stop": ["a"]}
    assert [max_stops(n) for n in (0, 1, 2, 3, 4, 9)] == [1, 1, 1, 1, 2, 4]


def test_starts_happen_even_while_stops_are_held() -> None:
    running = {s: R(s) for s in "abc"}
    plan = compute_plan({"x": D("x")}, running, now=0)
    assert kinds(plan) == {"start": ["x"]} and set(plan.held_stops) == set("abc")


# --- properties -------------------------------------------------------------------------

_ids = st.sampled_from(["s0", "s1", "s2", "s3", "s4", "s5"])
_digests = st.sampled_from(["d1", "d2"])
_desired = st.dictionaries(
    _ids,
    st.builds(
        lambda d, state, launchable, susp: (d, state, launchable, susp),
        _digests,
        st.sampled_from(["running", "running", "suspended", "stopped"]),
        st.booleans(),
        st.booleans(),
    ),
    max_size=6,
)
_running = st.dictionaries(
    _ids,
    st.builds(
        lambda d, phase, restart_at, susp: (d, phase, restart_at, susp),
        _digests,
        st.sampled_from(["unadopted", "live", "exited", "stopping"]),
        st.sampled_from([0.0, 10.0]),
        st.booleans(),
    ),
    max_size=6,
)


def _world(
    desired_raw: dict[str, tuple[str, str, bool, bool]],
    running_raw: dict[str, tuple[str, str, float, bool]],
) -> tuple[dict[str, DesiredView], dict[str, RunningView]]:
    desired = {
        s: DesiredView(s, d, state=state, launchable=ok, suspendable=susp)  # type: ignore[arg-type]
        for s, (d, state, ok, susp) in desired_raw.items()
    }
    running = {
        s: RunningView(s, d, phase=phase, restart_at=at, suspended=susp)  # type: ignore[arg-type]
        for s, (d, phase, at, susp) in running_raw.items()
    }
    return desired, running


def _apply(
    plan: Plan, desired: dict[str, DesiredView], running: dict[str, RunningView]
) -> dict[str, RunningView]:
    """What the shell makes of a plan once every action completed."""
    out = dict(running)
    for a in plan.actions:
        d = desired.get(a.shard_id)
        if a.kind in ("start", "replace"):
            assert d is not None
            out[a.shard_id] = RunningView(a.shard_id, d.digest, "live")
        elif a.kind == "adopt":
            out[a.shard_id] = replace(out[a.shard_id], phase="live")
        elif a.kind in ("stop", "forget"):
            del out[a.shard_id]
        elif a.kind in ("suspend", "resume"):
            out[a.shard_id] = replace(out[a.shard_id], suspended=a.kind == "suspend")
    return out


@given(_desired, _running, st.booleans())
def test_converges_and_then_does_nothing(
    desired_raw: dict[str, tuple[str, str, bool, bool]],
    running_raw: dict[str, tuple[str, str, float, bool]],
    drain: bool,
) -> None:
    desired, running = _world(desired_raw, running_raw)
    # Stops in progress finish first (the shell completes them asynchronously).
    running = {s: r for s, r in running.items() if r.phase != "stopping"}
    plan = compute_plan(desired, running, now=5.0, confirmed_drain=True)
    after = _apply(plan, desired, running)
    # An adopted engine's suspension is unknown until adopted: one more pass at most.
    after = _apply(compute_plan(desired, after, now=5.0, confirmed_drain=True), desired, after)
    again = compute_plan(desired, after, now=5.0, confirmed_drain=drain)
    # Only exited shards still in backoff may remain, waiting.
    assert again.actions == (), again
    for sid, d in desired.items():
        if d.launchable and (d.state == "running" or (d.state == "suspended" and d.suspendable)):
            r = after.get(sid)
            assert r is not None
            assert (r.phase == "live" and r.digest == d.digest) or (
                r.phase == "exited" and r.restart_at > 5.0 and r.digest == d.digest
            )


@given(_desired, _running, st.booleans())
def test_one_action_per_shard_and_the_half_rule(
    desired_raw: dict[str, tuple[str, str, bool, bool]],
    running_raw: dict[str, tuple[str, str, float, bool]],
    drain: bool,
) -> None:
    desired, running = _world(desired_raw, running_raw)
    plan = compute_plan(desired, running, now=5.0, confirmed_drain=drain)
    ids = [a.shard_id for a in plan.actions]
    assert len(ids) == len(set(ids))
    stops = [a for a in plan.actions if a.kind == "stop"]
    live = sum(1 for r in running.values() if r.phase in ("live", "unadopted"))
    if not drain:
        assert len(stops) <= max_stops(live)
    assert not (set(plan.held_stops) & set(ids))
    # Never an action on something the node cannot launch, except keeping what runs.
    for a in plan.actions:
        d = desired.get(a.shard_id)
        if d is not None and not d.launchable:
            assert a.kind == "adopt"
        if a.kind in ("stop",) and d is not None:
            assert not d.launchable or d.state != "running"
