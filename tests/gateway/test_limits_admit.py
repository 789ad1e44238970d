"""Limiter: each limit refuses with 429 and a Retry-After that is right, settle corrects the
reservation, release gives back what was not used, and a refusal takes nothing."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from llmgw.gateway.accounting import UsageRecorder
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.keys import KeyContext
from llmgw.gateway.limits import Limiter
from tests.gateway.keys_testkit import insert_key, sessions_on

pytestmark = pytest.mark.timeout(60)

# 2026-11-15 18:00:00 UTC: six hours before the day's quota resets.
WALL = datetime(2026, 11, 15, 18, 0, 0, tzinfo=UTC).timestamp()


class Clocks:
    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = WALL

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += s


def _key(**limits: Any) -> KeyContext:
    base: dict[str, Any] = dict(
        key_id="k1", name="tenant", allowed_models=None, cache_salt=None, rpm=None, tpm=None,
        token_quota=None, quota_period=None, concurrency=None,
    )  # fmt: skip
    base.update(limits)
    return KeyContext(**base)


def _setup(sessions: Any = None) -> tuple[Limiter, UsageRecorder, Clocks]:
    clocks = Clocks()
    # The recorder reads the same fake wall clock as the limiter: on the real clock its
    # totals would be keyed by the real month, which is not the limiter's once WALL's is over.
    rec = UsageRecorder(sessions=sessions, clock=lambda: clocks.wall)
    return (
        Limiter(recorder=rec, clock=lambda: clocks.mono, wall_clock=lambda: clocks.wall),
        rec,
        clocks,
    )


def _refused(limiter: Limiter, key: KeyContext, reserve: int = 0) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        limiter.admit(key, "m", reserve)
    assert info.value.status == 429
    return info.value


def test_rpm_refuses_the_request_over_the_minute_and_says_when_to_come_back() -> None:
    limiter, _, clocks = _setup()
    key = _key(rpm=3)
    for _ in range(3):
        limiter.admit(key, "m", 0).release()
    err = _refused(limiter, key)
    assert err.code == "rate_limit_exceeded" and "3 requests per minute" in err.message
    assert err.retry_after_s == pytest.approx(20.0)  # one request refills in 60/3 s
    assert err.headers() == {"Retry-After": "20"}
    clocks.advance(19.9)
    _refused(limiter, key)
    clocks.advance(0.1)
    limiter.admit(key, "m", 0).release()


def test_tpm_counts_reservations_and_settle_corrects_them() -> None:
    limiter, rec, clocks = _setup()
    key = _key(tpm=100)
    first = limiter.admit(key, "m", 60)
    err = _refused(limiter, key, 60)
    assert "100 tokens per minute" in err.message
    assert err.retry_after_s == pytest.approx(12.0)  # 20 missing at 100/60 per s
    # It used 10 of its 60: 50 come back, and the next request fits.
    first.settle(prompt_tokens=8, completion_tokens=2, cached_tokens=0)
    first.release()
    second = limiter.admit(key, "m", 60)
    # Used more than reserved: the bucket goes below zero and the wait grows.
    second.settle(prompt_tokens=50, completion_tokens=100, cached_tokens=0)
    second.release()
    err = _refused(limiter, key, 10)
    assert err.retry_after_s == pytest.approx((10 + 60) * 60 / 100)
    clocks.advance(42.0)
    limiter.admit(key, "m", 10).release()
    assert rec.period_tokens("k1", "day") == 10 + 150


def test_a_request_bigger_than_the_tpm_is_told_to_lower_max_tokens() -> None:
    limiter, _, _ = _setup()
    err = _refused(limiter, _key(tpm=100), 101)
    assert "lower max_tokens" in err.message and err.retry_after_s == 60


def test_concurrency_counts_requests_in_flight() -> None:
    limiter, _, _ = _setup()
    key = _key(concurrency=2)
    a = limiter.admit(key, "m", 0)
    b = limiter.admit(key, "m", 0)
    err = _refused(limiter, key)
    assert "2 requests in flight" in err.message and err.headers() == {"Retry-After": "1"}
    a.release()
    a.release()  # idempotent: frees one slot, not two
    c = limiter.admit(key, "m", 0)
    _refused(limiter, key)
    with b, c:
        pass
    assert limiter.in_flight("k1") == 0


def test_quota_reserves_up_front_and_resets_with_the_period() -> None:
    limiter, rec, clocks = _setup()
    key = _key(token_quota=100, quota_period="day")
    first = limiter.admit(key, "m", 60)
    err = _refused(limiter, key, 60)
    assert (err.code, err.type) == ("insufficient_quota", "insufficient_quota")
    assert "40 of its 100 tokens per day left" in err.message
    assert err.retry_after_s == pytest.approx(6 * 3600)  # midnight UTC
    first.settle(prompt_tokens=20, completion_tokens=10, cached_tokens=5)
    first.release()
    assert rec.period_tokens("k1", "day") == 30 and limiter.reserved("k1") == 0
    second = limiter.admit(key, "m", 70)  # 30 used + 70 = the whole quota
    second.release()  # never settled: nothing was used, the reservation comes back
    assert limiter.reserved("k1") == 0 and rec.period_tokens("k1", "day") == 30
    limiter.admit(key, "m", 70).settle(prompt_tokens=70, completion_tokens=0, cached_tokens=0)
    _refused(limiter, key, 1)
    clocks.advance(6 * 3600)  # a new day
    limiter.admit(key, "m", 100).release()


def test_a_refusal_takes_nothing_from_the_other_limits() -> None:
    limiter, _, clocks = _setup()
    key = _key(rpm=1, tpm=100, concurrency=5, token_quota=50, quota_period="month")
    for _ in range(3):
        _refused(limiter, key, 60)  # over the quota: no rpm, tpm or slot taken
    assert limiter.in_flight("k1") == 0
    limiter.admit(key, "m", 50).release()
    err = _refused(limiter, key, 10)
    assert err.code == "rate_limit_exceeded"  # rpm, checked before tpm and quota
    clocks.advance(60)
    limiter.admit(key, "m", 40).release()


def test_settle_after_release_still_bills_what_was_streamed() -> None:
    limiter, rec, _ = _setup()
    key = _key(tpm=1000, token_quota=10_000, quota_period="day")
    adm = limiter.admit(key, "m", 500)
    adm.release()  # the client went away; the stream's usage comes after
    adm.settle(prompt_tokens=100, completion_tokens=20, cached_tokens=0)
    adm.settle(prompt_tokens=100, completion_tokens=20, cached_tokens=0)  # once only
    assert rec.period_tokens("k1", "day") == 120 and limiter.reserved("k1") == 0
    # tpm: the 500 came back on release, the 120 used were taken on settle.
    assert "tokens per minute" in _refused(limiter, key, 881).message
    limiter.admit(key, "m", 880).release()


def test_limits_are_per_key_and_follow_a_changed_key() -> None:
    limiter, _, _ = _setup()
    limiter.admit(_key(rpm=1), "m", 0).release()
    limiter.admit(_key(key_id="k2", rpm=1), "m", 0).release()
    _refused(limiter, _key(rpm=1))
    # Unlimited keys, and limits removed by an admin, refuse nothing.
    for _ in range(100):
        limiter.admit(_key(), "m", 10**9).release()


async def test_a_quota_spent_through_another_gateway_is_refused_here(db_url: str) -> None:
    async with sessions_on(db_url) as sessions:
        key_id, _ = await insert_key(sessions, "shared", quota=1000, period="month")
        key = _key(key_id=key_id, token_quota=1000, quota_period="month")
        gw1, rec1, _ = _setup(sessions)
        gw2, rec2, _ = _setup(sessions)
        gw1.admit(key, "m", 900).settle(prompt_tokens=800, completion_tokens=100, cached_tokens=0)
        gw2.admit(key, "m", 900).release()  # gw2 has not seen gw1's usage yet
        await rec1.flush()
        await rec2.refresh_totals()
        err = _refused(gw2, key, 200)
        assert err.code == "insufficient_quota" and "100 of its 1000" in err.message
        gw2.admit(key, "m", 100).release()
