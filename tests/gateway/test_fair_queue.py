"""The gateway queue's pure core: bounds, fairness across keys by tokens served, the lift
that keeps idle keys from banking credit, removal, and the drain rate behind Retry-After."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.gateway.routing.fair_queue import DrainRate, Entry, FairQueue


def _queue(max_requests: int = 100, max_bytes: int = 10_000) -> FairQueue[int]:
    return FairQueue(max_requests=max_requests, max_bytes=max_bytes)


def _push(q: FairQueue[int], key: str, item: int, size: int = 1, prio: int = 0) -> Entry[int]:
    got = q.push(key, item, size_bytes=size, now=float(item), priority=prio)
    assert isinstance(got, Entry)
    return got


def _drain(q: FairQueue[int], tokens: int = 0) -> list[tuple[str, int]]:
    out = []
    while (e := q.pop()) is not None:
        out.append((e.key, e.item))
        q.charge(e.key, tokens)
    return out


def test_bounds_refuse_with_the_bound_hit() -> None:
    q = _queue(max_requests=2, max_bytes=10)
    _push(q, "a", 1, size=6)
    assert q.push("a", 2, size_bytes=5, now=0, priority=0) == "queue_bytes"
    _push(q, "b", 3, size=4)
    assert q.push("c", 4, size_bytes=0, now=0, priority=0) == "queue_requests"
    assert (len(q), q.num_bytes) == (2, 10)


def test_fifo_within_a_key() -> None:
    q = _queue()
    for i in range(5):
        _push(q, "a", i)
    assert [item for _, item in _drain(q)] == [0, 1, 2, 3, 4]


def test_a_burst_does_not_starve_a_steady_key() -> None:
    """Key a queues 50 before b's one request: b leaves second, not 51st."""
    q = _queue()
    for i in range(50):
        _push(q, "a", i)
    _push(q, "b", 100)
    order = _drain(q, tokens=10)
    assert order[:2] == [("a", 0), ("b", 100)]


def test_counters_weigh_tokens_not_requests() -> None:
    """a is charged 100 tokens per request, b 10: b gets ~10 requests per one of a's."""
    q = _queue()
    for i in range(20):
        _push(q, "a", i)
        _push(q, "b", 100 + i)
    served = []
    for _ in range(22):
        e = q.pop()
        assert e is not None
        served.append(e.key)
        q.charge(e.key, 100 if e.key == "a" else 10)
    assert served.count("a") == 2 and served.count("b") == 20


def test_priority_weights_the_counter() -> None:
    """A key of priority 1 is served twice the tokens of a priority-0 key."""
    q = _queue()
    for i in range(30):
        _push(q, "lo", i, prio=0)
        _push(q, "hi", 100 + i, prio=1)
    served = []
    for _ in range(30):
        e = q.pop()
        assert e is not None
        served.append(e.key)
        q.charge(e.key, 10)
    assert served.count("hi") == 20 and served.count("lo") == 10


def test_an_idle_key_banks_no_credit() -> None:
    """b was served nothing while a was served 10,000 tokens; when b arrives with a burst it
    joins at a's counter and the two alternate, instead of b taking 1,000 turns in a row."""
    q = _queue(max_requests=1000)
    for i in range(100):
        _push(q, "a", i)
        e = q.pop()
        assert e is not None
        q.charge("a", 100)
    for i in range(10):
        _push(q, "a", 1000 + i)
        _push(q, "b", 2000 + i)
    keys = [k for k, _ in _drain(q, tokens=100)]
    assert keys[:6] in (["a", "b"] * 3, ["b", "a"] * 3)


def test_remove_counts_out_at_once_and_is_skipped() -> None:
    q = _queue()
    entries = [_push(q, "a", i, size=3) for i in range(4)]
    assert q.remove(entries[0]) and q.remove(entries[2])
    assert not q.remove(entries[2])
    assert (len(q), q.num_bytes, q.queued("a")) == (2, 6, 2)
    assert [item for _, item in _drain(q)] == [1, 3]
    assert len(q) == 0 and q.oldest() is None


def test_removed_entries_are_compacted() -> None:
    q = _queue(max_requests=10_000)
    keep = _push(q, "a", 0)
    gone = [_push(q, "a", i) for i in range(1, 1000)]
    for e in gone:
        q.remove(e)
    assert len(q._keys["a"].entries) < 50
    assert q.pop() is keep


def test_forget_idle_drops_keys_at_the_floor() -> None:
    q = _queue()
    _push(q, "a", 0)
    q.pop()
    q.forget_idle()
    assert list(q.keys()) == [] and "a" not in q._keys


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "pop", "remove"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 50),
        ),
        max_size=200,
    )
)
def test_counts_match_the_living_and_order_is_fifo_per_key(ops: list[tuple[str, str, int]]) -> None:
    """Any sequence of pushes, pops and removals: the counts are those of the entries still
    queued, bounds hold, nothing leaves twice, and each key's requests leave in order."""
    q = _queue(max_requests=30, max_bytes=500)
    living: list[Entry[int]] = []
    seq = 0
    left: dict[str, list[int]] = {}
    for op, key, n in ops:
        if op == "push":
            got = q.push(key, seq, size_bytes=n, now=seq, priority=n % 3)
            if isinstance(got, Entry):
                living.append(got)
            else:
                assert len(q) + 1 > 30 or q.num_bytes + n > 500
            seq += 1
        elif op == "pop":
            e = q.pop()
            if e is None:
                assert not living
                continue
            assert e in living
            living.remove(e)
            left.setdefault(e.key, []).append(e.item)
            q.charge(e.key, n)
        elif living:
            e = living[n % len(living)]
            assert q.remove(e)
            living.remove(e)
        assert len(q) == len(living) <= 30
        assert q.num_bytes == sum(e.size_bytes for e in living) <= 500
        assert set(q.keys()) == {e.key for e in living}
    for items in left.values():
        assert items == sorted(items)


def test_drain_rate_and_retry_after() -> None:
    rate = DrainRate(window_s=1.0, weight=0.5)
    rate.record(0.0, 0)
    for t in range(10):
        rate.record(t + 0.5, 100)
    assert 60 < rate.rate(10.0) <= 100
    assert rate.retry_after_s(200, 10.0, floor_s=1, ceiling_s=30) < 4
    # Nothing leaves for a while: the rate decays and the advice grows to its ceiling.
    assert rate.retry_after_s(200, 40.0, floor_s=1, ceiling_s=30) == 30
    assert DrainRate().retry_after_s(5, 0.0, floor_s=1, ceiling_s=9) == 9
