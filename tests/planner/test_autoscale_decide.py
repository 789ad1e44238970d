"""decide: the autoscaler's pure core, table tests and properties (no I/O)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.planner.autoscale import (
    AutoscalePolicy,
    DemandSample,
    History,
    ScaleState,
    decide,
    format_tokens,
)

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)

POLICY = AutoscalePolicy(
    min_replicas=0,
    max_replicas=8,
    target_queued_prefill_tokens=8000,
    scale_up_window_s=30,
    scale_down_window_s=120,
    suspend_after_s=300,
    zero_after_s=900,
)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def samples(start: float, end: float, step: float = 2.0, **fields: int) -> tuple[DemandSample, ...]:
    out = []
    t = start
    while t <= end:
        out.append(DemandSample(at=at(t), gateways=fields.pop("gateways", 1), **fields))
        t += step
    return tuple(out)


def busy(start: float, end: float, tokens: int, in_flight: int = 4) -> tuple[DemandSample, ...]:
    return samples(start, end, uncached_prefill_tokens=tokens, in_flight=in_flight)


def state(desired: int, warm: int | None = None, **kw: object) -> ScaleState:
    return ScaleState(desired=desired, warm=desired if warm is None else warm, **kw)  # type: ignore[arg-type]


def test_scales_up_after_the_window_with_the_reason_the_issue_shows() -> None:
    h = History(busy(0, 30, tokens=2 * 38_000), state(2))
    d = decide(h, POLICY, at(30))
    assert (d.desired, d.changed) == (4, True)
    assert d.reason == ("scaled 2\u21924: queued prefill 38k tokens/replica > target 8k for 30 s")
    assert d.last_scaled_at == at(30)


def test_no_scale_up_before_the_history_spans_the_window() -> None:
    # A new leader has 20 s of samples: a 30 s window is not yet evidence.
    h = History(busy(10, 30, tokens=100_000), state(2))
    assert decide(h, POLICY, at(30)).changed is False


def test_a_spike_shorter_than_the_window_does_not_scale() -> None:
    quiet = busy(0, 20, tokens=1000)
    spike = busy(22, 30, tokens=500_000)
    assert decide(History(quiet + spike, state(2)), POLICY, at(30)).desired == 2


def test_one_step_per_window_at_most_doubling() -> None:
    h = History(busy(0, 30, tokens=1_000_000), state(1))
    d = decide(h, POLICY, at(30))
    assert d.desired == 2  # need is 125, capped at max 8 and doubling from 1
    again = History(busy(0, 40, tokens=1_000_000), state(2, last_scaled_at=at(30)))
    assert decide(again, POLICY, at(40)).changed is False  # 10 s after the last step
    later = History(busy(0, 60, tokens=1_000_000), state(2, last_scaled_at=at(30)))
    assert decide(later, POLICY, at(60)).desired == 4


def test_no_step_while_the_last_one_is_not_serving() -> None:
    # 2 desired, 1 serving (the other still starting): the backlog it grows is not a reason
    # to double again; once both serve, the next step comes.
    h = History(busy(0, 30, tokens=1_000_000), state(2, ready=1))
    assert decide(h, POLICY, at(30)).changed is False
    h2 = History(busy(0, 30, tokens=1_000_000), state(2, ready=2))
    assert decide(h2, POLICY, at(30)).desired == 4


def test_never_above_max() -> None:
    h = History(busy(0, 30, tokens=10_000_000), state(6))
    assert decide(h, POLICY, at(30)).desired == 8


def test_bounds_corrected_at_once_after_a_policy_edit() -> None:
    p = AutoscalePolicy(min_replicas=2, max_replicas=3, target_waiting_requests=4)
    up = decide(History((), state(0)), p, at(0))
    assert (up.desired, up.warm) == (2, 2)
    assert "policy bounds 2..3" in up.reason
    down = decide(History((), state(5)), p, at(0))
    assert (down.desired, down.warm) == (3, 3)


def test_scales_down_after_the_down_window_within_hysteresis() -> None:
    # 4 replicas, 14k queued over the fleet: 14k / (8k * 0.8) -> 3 replicas.
    h = History(busy(0, 120, tokens=14_000), state(4))
    d = decide(h, POLICY, at(120))
    assert d.desired == 3
    assert d.reason.startswith("scaled 4\u21923: queued prefill 3.5k tokens/replica < target 8k")


def test_hysteresis_band_holds_a_load_right_at_the_target() -> None:
    # 3 replicas at 7.5k each (between 80 % and 100 % of the target): neither way.
    h = History(busy(0, 300, tokens=3 * 7500), state(3))
    assert decide(h, POLICY, at(300)).changed is False


def test_down_needs_every_sample_of_the_window_known() -> None:
    # A gap with no gateway report is no evidence of idleness.
    quiet = samples(0, 60, in_flight=1)
    gap = samples(62, 120, gateways=0)
    assert decide(History(quiet + gap, state(4)), POLICY, at(120)).changed is False


def test_down_rule_keeps_the_last_replica_when_idle_rules_are_set() -> None:
    h = History(samples(0, 120), state(1))  # idle for 120 s < suspend_after_s
    assert decide(h, POLICY, at(120)).changed is False
    no_idle_rules = AutoscalePolicy(min_replicas=0, max_replicas=4, target_waiting_requests=2,
                                    scale_down_window_s=120)  # fmt: skip
    assert decide(h, no_idle_rules, at(120)).desired == 0


def test_idle_suspends_then_stops_above_min() -> None:
    h = History(samples(0, 300), state(2))
    d = decide(h, POLICY, at(300))
    assert (d.desired, d.warm) == (0, 2)
    assert "suspended: idle for 300 s" in d.reason
    assert d.idle_since == at(0)
    assert d.suspended_since == at(300)
    later = History(
        samples(300, 900),
        state(0, 2, idle_since=at(0), last_scaled_at=at(300), suspended_since=d.suspended_since),
    )
    z = decide(later, POLICY, at(900))
    assert (z.desired, z.warm) == (0, 0)
    assert "stopped 2 suspended replicas" in z.reason


def test_suspended_replicas_stop_at_zero_after_s_even_when_a_trickle_returns() -> None:
    # Suspended at 300 s; a trickle keeps one replica serving from 400 s: the other stays
    # asleep until it has been idle zero_after_s (900 s) in all, then stops.
    trickle = samples(400, 899, in_flight=1)
    st = state(1, 3, idle_since=None, last_scaled_at=at(400), suspended_since=at(300))
    before = decide(History(trickle, st), POLICY, at(899))
    assert (before.desired, before.warm) == (1, 3) and before.suspended_since == at(300)
    after = decide(History(trickle + samples(900, 900, in_flight=1), st), POLICY, at(900))
    assert (after.desired, after.warm) == (1, 1) and after.suspended_since is None
    assert after.reason == "stopped 2 suspended replicas: idle for 900 s \u2265 zero_after_s 900"


def test_idle_with_min_replicas_keeps_min_serving() -> None:
    p = AutoscalePolicy(min_replicas=1, max_replicas=4, target_waiting_requests=2,
                        suspend_after_s=60, zero_after_s=120)  # fmt: skip
    d = decide(History(samples(0, 120), state(3)), p, at(120))
    assert (d.desired, d.warm) == (1, 1)


def test_idle_since_survives_a_leader_change_through_the_state() -> None:
    # The new leader holds 4 s of samples, but the stored idle_since says 300 s.
    h = History(samples(296, 300), state(1, idle_since=at(0)))
    d = decide(h, POLICY, at(300))
    assert (d.desired, d.warm) == (0, 1)


def test_activity_resets_idle() -> None:
    s = samples(0, 250) + samples(252, 252, in_flight=1) + samples(254, 300)
    d = decide(History(s, state(1, idle_since=at(0))), POLICY, at(300))
    assert d.changed is False
    assert d.idle_since == at(254)


def test_wake_from_zero_at_once_on_held_requests() -> None:
    s = samples(0, 2, held=3, waiting_requests=3)
    d = decide(History(s, state(0, 2)), POLICY, at(2))
    assert (d.desired, d.warm) == (1, 2)
    assert d.reason == "scaled 0\u21921: woken: 3 requests held with no ready replica"


def test_two_gateways_holding_wake_one_replica() -> None:
    # Summed over two gateways: one wake, and the next pass (replica not ready yet, still
    # held) does not add another inside the up window.
    s = samples(0, 0, held=2, waiting_requests=2, gateways=2)
    d = decide(History(s, state(0)), POLICY, at(0))
    assert d.desired == 1
    s2 = s + samples(2, 10, held=2, waiting_requests=2, gateways=2)
    again = decide(History(s2, state(1, last_scaled_at=at(0))), POLICY, at(10))
    assert again.changed is False


def test_no_wake_when_max_is_zero() -> None:
    p = AutoscalePolicy(min_replicas=0, max_replicas=0, target_waiting_requests=1)
    assert decide(History(samples(0, 0, held=1), state(0)), p, at(0)).changed is False


def test_frozen_rollout_changes_nothing() -> None:
    h = History(busy(0, 60, tokens=1_000_000), state(2, frozen="progress deadline exceeded"))
    d = decide(h, POLICY, at(60))
    assert (d.desired, d.changed) == (2, False)
    assert d.reason == "scaling frozen: progress deadline exceeded"


def test_waiting_target() -> None:
    p = AutoscalePolicy(min_replicas=1, max_replicas=10, target_waiting_requests=4,
                        scale_up_window_s=0)  # fmt: skip
    d = decide(History(samples(0, 0, waiting_requests=20), state(2)), p, at(0))
    assert d.desired == 4  # need 5, one step doubles 2 -> 4
    assert "waiting 10.0 requests/replica > target 4" in d.reason


def test_scale_up_consumes_suspended_replicas_first_warm_kept() -> None:
    h = History(busy(0, 30, tokens=30_000), state(1, 3))
    d = decide(h, POLICY, at(30))
    assert (d.desired, d.warm) == (2, 3)


@pytest.mark.parametrize(("n", "text"), [(900, "900"), (8192, "8.2k"), (38_000, "38k"),
                                          (8000, "8k")])  # fmt: skip
def test_format_tokens(n: int, text: str) -> None:
    assert format_tokens(n) == text


_sample = st.builds(
    DemandSample,
    at=st.just(T0),
    gateways=st.integers(0, 3),
    waiting_requests=st.integers(0, 200),
    uncached_prefill_tokens=st.integers(0, 2_000_000),
    in_flight=st.integers(0, 50),
    held=st.integers(0, 20),
)
_policy = st.builds(
    AutoscalePolicy,
    min_replicas=st.integers(0, 3),
    max_replicas=st.integers(3, 12),
    target_queued_prefill_tokens=st.one_of(st.none(), st.integers(1, 50_000)),
    target_waiting_requests=st.one_of(st.none(), st.floats(0.5, 20)),
    scale_up_window_s=st.sampled_from([0.0, 10.0, 30.0]),
    scale_down_window_s=st.sampled_from([0.0, 60.0, 300.0]),
    suspend_after_s=st.one_of(st.none(), st.just(60.0)),
    zero_after_s=st.one_of(st.none(), st.just(120.0)),
)


@settings(max_examples=300, deadline=None)
@given(
    _policy,
    st.lists(_sample, max_size=40),
    st.integers(0, 15),
    st.integers(0, 5),
    st.booleans(),
)
def test_properties(
    p: AutoscalePolicy, raw: list[DemandSample], desired: int, extra: int, frozen: bool
) -> None:
    from dataclasses import replace

    s = tuple(replace(x, at=at(i * 5)) for i, x in enumerate(raw))
    now = at(len(s) * 5)
    st_ = ScaleState(desired, desired + extra, frozen="stalled" if frozen else "")
    d = decide(History(s, st_), p, now)
    assert d.warm >= d.desired
    if frozen:
        assert (d.desired, d.warm, d.changed) == (desired, desired + extra, False)
        return
    assert p.min_replicas <= d.desired <= p.max_replicas
    if d.desired > desired and p.min_replicas <= desired:
        assert d.desired <= max(2 * desired, 1)  # one step at most doubles
    if d.changed:
        assert d.reason.startswith(("scaled", "stopped")) and d.last_scaled_at == now
        # Deciding again at once moves nothing up: one step per window.
        st2 = ScaleState(d.desired, d.warm, d.last_scaled_at, d.idle_since)
        d2 = decide(History(s, st2), p, now)
        if p.scale_up_window_s > 0 and d2.changed and p.min_replicas <= d.desired:
            assert d2.desired <= d.desired or d.desired == 0


CPU_VLLM = "vLLM's sleep mode is CUDA-only, and the profile runs on the CPU"


def test_idle_replicas_that_cannot_suspend_are_stopped_instead_saying_why() -> None:
    """Issue 35: a CPU vLLM replica has no sleep mode; a placement kept for an engine its agent
    stops would hold CPU threads that serve nobody."""
    h = History(samples(0, 300), state(2))
    d = decide(h, POLICY, at(300), suspend_refusal=CPU_VLLM)
    assert (d.desired, d.warm, d.changed) == (0, 0, True)
    assert d.reason == (
        "scaled 2\u21920: stopped, not suspended (vLLM's sleep mode is CUDA-only, and the "
        "profile runs on the CPU): idle for 300 s \u2265 suspend_after_s 300"
    )
    assert d.suspended_since is None
    # Replicas suspended before the profile lost its sleep (an edit) are stopped at once.
    asleep = state(1, 3, suspended_since=at(100), last_scaled_at=at(100))
    s = decide(History(samples(290, 300, in_flight=1), asleep), POLICY, at(300),
               suspend_refusal=CPU_VLLM)  # fmt: skip
    assert (s.desired, s.warm) == (1, 1)
    assert s.reason == f"stopped 2 suspended replicas: they cannot suspend ({CPU_VLLM})"
    # A wake from zero is unaffected.
    w = decide(History(samples(0, 2, held=1), state(0)), POLICY, at(2), suspend_refusal=CPU_VLLM)
    assert (w.desired, w.warm) == (1, 1)
