"""The one token bucket (llmgw.ratelimit): a burst at once, then the rate; what a refusal says
to wait; a take past the level and a credit back; a bucket refilled only by credits (the
gateway's retry budget)."""

from __future__ import annotations

import math

import pytest

from llmgw.gateway.load import RetryBudget
from llmgw.ratelimit import TokenBucket


def test_a_burst_then_the_rate_and_the_wait_it_names() -> None:
    bucket = TokenBucket(rate_per_s=2.0, burst=3)
    assert [bucket.admit(10.0) for _ in range(3)] == [None, None, None]
    assert bucket.admit(10.0) == pytest.approx(0.5)  # one token in 1/2 s
    assert bucket.admit(10.25) == pytest.approx(0.25)  # half of it came; nothing taken
    assert bucket.admit(10.5) is None
    assert bucket.refill(100.0) == 3.0  # never past the burst
    assert bucket.admit(100.0, amount=4.0) == pytest.approx(0.5)  # more than it holds: wait


def test_a_take_may_overdraw_and_a_credit_gives_back_up_to_the_burst() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=10)
    bucket.refill(0.0)
    bucket.take(15.0)  # used more than it reserved
    assert bucket.level == -5.0 and bucket.wait_s(1.0) == pytest.approx(6.0)
    bucket.credit(4.0)
    assert bucket.refill(2.0) == pytest.approx(1.0)
    bucket.credit(100.0)
    assert bucket.level == 10.0


def test_a_bucket_without_a_rate_fills_only_by_credits() -> None:
    bucket = TokenBucket(rate_per_s=0.0, burst=2)
    assert bucket.admit(0.0) is None and bucket.admit(0.0) is None
    assert bucket.admit(1e9) == math.inf  # time never refills it
    bucket.credit(0.5)
    bucket.credit(0.5)
    assert bucket.admit(1e9) is None


def test_the_retry_budget_is_filled_by_requests() -> None:
    budget = RetryBudget(ratio=0.5, burst=2.0)
    assert budget.withdraw() and budget.withdraw() and not budget.withdraw()
    budget.deposit()
    assert not budget.withdraw()  # half a token
    budget.deposit()
    assert budget.withdraw()
    off = RetryBudget(ratio=0.0)
    off.deposit()
    assert not off.withdraw()  # no retries at all


@pytest.mark.parametrize(("rate", "burst"), [(-1.0, 5), (1.0, 0)])
def test_a_bucket_needs_a_rate_and_room_for_one(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="token bucket"):
        TokenBucket(rate_per_s=rate, burst=burst)
