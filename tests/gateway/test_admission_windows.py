"""Per-replica admission: the room left under the ceiling, AIMD on busy and success."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.gateway.routing.admission import AdmissionWindows


def test_room_counts_ours_and_others() -> None:
    w = AdmissionWindows()
    w.configure([("r1", 10)])
    assert w.room("r1", 4, 3) == 3
    assert w.room("r1", 8, 5) == -3
    assert w.room("unknown", 10**6, 0) > 10**6


def test_busy_halves_and_success_adds_one_back() -> None:
    w = AdmissionWindows()
    w.configure([("r1", 64)])
    assert w.busy("r1") == 32 and w.busy("r1") == 16
    for _ in range(10):
        w.succeeded("r1")
    assert w.limit("r1") == 26
    for _ in range(100):
        w.succeeded("r1")
    assert w.limit("r1") == 64


def test_limit_never_below_one() -> None:
    w = AdmissionWindows()
    w.configure([("r1", 3)])
    for _ in range(10):
        w.busy("r1")
    assert w.limit("r1") == 1 and w.room("r1", 0, 0) == 1


def test_configure_clips_keeps_the_busy_limit_and_forgets() -> None:
    w = AdmissionWindows()
    w.configure([("r1", 100), ("r2", 10)])
    w.busy("r1")
    w.configure([("r1", 200), ("r2", 20)])
    assert w.limit("r1") == 50  # busy: grows back by successes, not jumps
    assert w.limit("r2") == 20  # was full: takes the new ceiling
    w.configure([("r1", 20)])
    assert w.limit("r1") == 20 and w.ceiling("r2") is None


def test_loaded_is_half_the_limit() -> None:
    w = AdmissionWindows()
    w.configure([("r1", 100)])
    assert w.loaded("r1", 50) and not w.loaded("r1", 49)
    assert not w.loaded("nobody", 1000)


@given(st.lists(st.booleans(), max_size=300), st.integers(1, 1000))
def test_limit_stays_within_one_and_the_ceiling(events: list[bool], ceiling: int) -> None:
    w = AdmissionWindows()
    w.configure([("r", ceiling)])
    for busy in events:
        if busy:
            w.busy("r")
        else:
            w.succeeded("r")
        limit = w.limit("r")
        assert limit is not None and 1 <= limit <= ceiling
