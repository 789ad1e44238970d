"""The runtime adapters' pure core (llmgw/nodeagent/adapter_diff.py): tables of one plan each,
what a binding reports, and a property: applying the calls one at a time, against an engine
that fails some of them, converges within the slots, never unloading a placed adapter."""

from __future__ import annotations

import ast
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.nodeagent import adapter_diff
from llmgw.nodeagent.adapter_diff import (
    AdapterCall,
    AdapterPlan,
    KnownAdapter,
    WantedAdapter,
    observed_adapters,
    plan_adapters,
)
from llmgw.periodic import backoff_delay
from llmgw.protocol.sync import AdapterObserved
from tests.test_package_map import IO_IMPORTS

W = WantedAdapter


def loaded(name: str, path: str = "", **kw: object) -> KnownAdapter:
    return KnownAdapter(name, "loaded", path or f"/a/{name}", **kw)  # type: ignore[arg-type]


def failed(name: str, **kw: object) -> KnownAdapter:
    return KnownAdapter(name, "failed", **kw)  # type: ignore[arg-type]


def known(*adapters: KnownAdapter) -> dict[str, KnownAdapter]:
    return {k.name: k for k in adapters}


def calls(plan: AdapterPlan) -> list[tuple[str, str]]:
    return [(c.kind, c.name) for c in plan.calls]


# --- one plan each ------------------------------------------------------------------------


def test_loads_what_is_placed_in_the_order_placed() -> None:
    plan = plan_adapters([W("a", "/a/a"), W("b", "/a/b")], {}, slots=4, now=0)
    assert plan.calls == (
        AdapterCall("load", "a", "/a/a", "placed here, not loaded"),
        AdapterCall("load", "b", "/a/b", "placed here, not loaded"),
    )
    assert plan.unplaced == plan.waiting == plan.forget == ()


def test_unloads_come_first_so_a_full_engine_makes_room() -> None:
    plan = plan_adapters([W("a", "/a/a")], known(loaded("x")), slots=1, now=0)
    assert calls(plan) == [("unload", "x"), ("load", "a")]
    assert plan.calls[0].reason == "no longer placed here"


def test_what_is_held_and_placed_is_left_alone() -> None:
    plan = plan_adapters([W("a", "/a/a")], known(loaded("a")), slots=1, now=0)
    assert plan == AdapterPlan()


def test_more_placed_than_slots_pinned_ones_first_the_rest_unplaced() -> None:
    wanted = [W("a", "/a/a"), W("b", "/a/b", pinned=True), W("c", "/a/c")]
    plan = plan_adapters(wanted, {}, slots=2, now=0)
    assert calls(plan) == [("load", "b"), ("load", "a")]
    assert [n for n, _ in plan.unplaced] == ["c"]
    assert plan.unplaced[0][1] == (
        "no free slot: all 2 adapter slots of the engine hold other adapters placed here "
        "(pinned ones first)"
    )


def test_a_held_placed_adapter_is_never_unloaded_to_make_room_for_a_pinned_one() -> None:
    wanted = [W("a", "/a/a"), W("p", "/a/p", pinned=True)]
    plan = plan_adapters(wanted, known(loaded("a")), slots=1, now=0)
    assert plan.calls == ()
    assert [n for n, _ in plan.unplaced] == ["p"]


def test_a_failed_load_waits_for_its_retry_and_keeps_its_slot() -> None:
    wanted = [W("a", "/a/a"), W("b", "/a/b")]
    state = known(failed("a", failures=2, retry_at=10.0, reason="404: no adapter"))
    early = plan_adapters(wanted, state, slots=1, now=5)
    assert early.calls == ()
    assert early.waiting == ("a",) and [n for n, _ in early.unplaced] == ["b"]
    assert early.next_retry_at == 10.0
    assert calls(plan_adapters(wanted, state, slots=1, now=10)) == [("load", "a")]


def test_a_new_path_unloads_then_loads_from_it() -> None:
    plan = plan_adapters([W("a", "/v2/a")], known(loaded("a", "/v1/a")), slots=1, now=0)
    assert plan.calls == (
        AdapterCall("unload", "a", reason="placed from a new path '/v2/a'"),
        AdapterCall("load", "a", "/v2/a", "placed here, not loaded"),
    )
    # A path the engine did not say is taken as the same: no reload.
    unknown = KnownAdapter("a", "loaded", "")
    assert plan_adapters([W("a", "/v2/a")], {"a": unknown}, slots=1, now=0) == AdapterPlan()


def test_an_unload_waiting_to_retry_still_holds_its_slot() -> None:
    state = known(loaded("x", retry_at=10.0, failures=1, reason="unload failed: 500"))
    plan = plan_adapters([W("a", "/a/a")], state, slots=1, now=0)
    assert plan.calls == () and plan.waiting == ("x",)
    assert [n for n, _ in plan.unplaced] == ["a"]
    assert calls(plan_adapters([W("a", "/a/a")], state, slots=1, now=10)) == [
        ("unload", "x"),
        ("load", "a"),
    ]


def test_a_failed_adapter_no_longer_placed_is_forgotten() -> None:
    plan = plan_adapters([], known(failed("a", failures=3, retry_at=99.0)), slots=2, now=0)
    assert plan == AdapterPlan(forget=("a",))


def test_no_slots_unloads_everything_and_loads_nothing() -> None:
    plan = plan_adapters([W("a", "/a/a")], known(loaded("x")), slots=0, now=0)
    assert calls(plan) == [("unload", "x")]
    assert [n for n, _ in plan.unplaced] == ["a"]


# --- what the binding reports -------------------------------------------------------------


def test_before_the_placement_is_known_what_the_engine_holds_is_reported_loaded() -> None:
    state = known(loaded("a"), failed("b", failures=1))
    assert observed_adapters(None, state, slots=2, now=0) == (
        AdapterObserved(name="a", state="loaded"),
    )


def test_every_placed_adapter_and_every_one_still_held_is_reported() -> None:
    wanted = [W("ok", "/a/ok"), W("bad", "/a/bad"), W("new", "/a/new"), W("over", "/a/over")]
    state = known(
        loaded("ok"),
        failed("bad", failures=2, retry_at=50.0, reason="404: No adapter found for /a/bad"),
        loaded("old", reason="unload failed: 500: boom", failures=1, retry_at=50.0),
    )
    # 4 slots: ok's, old's until its unload succeeds, the one bad keeps for its retry, new's.
    got = observed_adapters(wanted, state, slots=4, now=0, waiting_for="")
    assert got == (
        AdapterObserved(name="ok", state="loaded"),
        AdapterObserved(
            name="bad", state="failed", reason="404: No adapter found for /a/bad", failures=2
        ),
        AdapterObserved(name="new", state="loading"),
        AdapterObserved(
            name="over",
            state="failed",
            reason="no free slot: all 4 adapter slots of the engine hold other adapters placed "
            "here (pinned ones first)",
        ),
        AdapterObserved(
            name="old", state="unloading", reason="unload failed: 500: boom", failures=1
        ),
    )
    # Nothing in it moves with the clock: an unchanged engine is an unchanged binding.
    assert observed_adapters(wanted, state, slots=4, now=40, waiting_for="") == got


def test_calls_under_way_and_waits_are_reported() -> None:
    wanted = [W("a", "/a/a"), W("b", "/a/b")]
    got = observed_adapters(
        wanted,
        known(loaded("x")),
        slots=3,
        now=0,
        in_flight=AdapterCall("load", "a", "/a/a"),
        waiting_for="waiting for the engine to be ready",
    )
    assert got == (
        AdapterObserved(name="a", state="loading"),
        AdapterObserved(name="b", state="loading", reason="waiting for the engine to be ready"),
        AdapterObserved(name="x", state="unloading"),
    )
    moved = observed_adapters([W("a", "/v2/a")], known(loaded("a", "/v1/a")), slots=1, now=0)
    assert moved == (
        AdapterObserved(name="a", state="loading", reason="reloading from its new path"),
    )


def test_a_name_the_protocol_cannot_carry_is_unloaded_but_not_reported() -> None:
    long_name = "x" * 300
    state = {long_name: KnownAdapter(long_name, "loaded", "/a/x")}
    assert calls(plan_adapters([], state, slots=1, now=0)) == [("unload", long_name)]
    assert observed_adapters([], state, slots=1, now=0) == ()


def test_the_core_does_no_io() -> None:
    path = Path(adapter_diff.__file__)
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            assert name.split(".")[0] not in IO_IMPORTS, name
            if name.startswith("llmgw."):
                assert name.startswith(("llmgw.protocol", "llmgw.errors")), name


# --- the property ------------------------------------------------------------------------

NAMES = ["a", "b", "c", "d", "e", "f"]


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[WantedAdapter], dict[str, str], int, list[bool]]:
    slots = draw(st.integers(0, 4))
    wanted = [
        W(n, draw(st.sampled_from([f"/v1/{n}", f"/v2/{n}"])), draw(st.booleans()))
        for n in draw(st.lists(st.sampled_from(NAMES), max_size=6))
    ]
    held_names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=slots))
    held = {n: draw(st.sampled_from([f"/v1/{n}", f"/v2/{n}"])) for n in held_names}
    # Which of the first calls the engine fails (then none: every failure is transient).
    failures = draw(st.lists(st.booleans(), max_size=12))
    return wanted, held, slots, failures


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_applying_the_calls_converges_within_the_slots(
    world: tuple[list[WantedAdapter], dict[str, str], int, list[bool]],
) -> None:
    wanted, engine, slots, fail_script = world
    state = {n: KnownAdapter(n, "loaded", p) for n, p in engine.items()}
    placed = {}
    for w in wanted:
        placed.setdefault(w.name, w)
    pinned_as_placed = {n for n, w in placed.items() if w.pinned and engine.get(n) == w.path}
    now, step = 0.0, 0
    for _ in range(200):
        plan = plan_adapters(wanted, state, slots=slots, now=now)
        for name in plan.forget:
            del state[name]
        if not plan.calls:
            if plan.next_retry_at is None:
                break
            now = plan.next_retry_at  # nothing to do until a retry is due
            continue
        call = plan.calls[0]
        fails = step < len(fail_script) and fail_script[step]
        step += 1
        prev = state.get(call.name)
        if fails:
            n = (prev.failures if prev is not None else 0) + 1
            retry = now + backoff_delay(n - 1, 1.0, 8.0)
            if call.kind == "load":
                state[call.name] = KnownAdapter(call.name, "failed", failures=n, retry_at=retry)
            else:
                assert prev is not None
                state[call.name] = KnownAdapter(call.name, "loaded", prev.path, n, retry)
        elif call.kind == "load":
            assert call.name not in engine, "a load of what the engine holds"
            engine[call.name] = call.path
            state[call.name] = KnownAdapter(call.name, "loaded", call.path)
        else:
            w = placed.get(call.name)
            # A placed adapter held as placed is never unloaded, pinned or not.
            assert w is None or engine[call.name] != w.path
            assert call.name not in pinned_as_placed
            del engine[call.name]
            del state[call.name]
        assert len(engine) <= slots, "more loaded than the engine's slots"
        now += 0.5
    else:
        raise AssertionError("did not converge in 200 steps")
    # Converged: the engine holds placed adapters only, as placed, as many as fit.
    assert all(n in placed and placed[n].path == p for n, p in engine.items())
    assert len(engine) == min(slots, len(placed))
    # And planning again asks for nothing.
    assert plan_adapters(wanted, state, slots=slots, now=now + 1000).calls == ()
