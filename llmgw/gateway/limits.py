"""Per-key limits, checked in memory before a request goes upstream.

``Limiter.admit`` checks, in this order, and takes nothing unless every check passes:

    concurrency  requests of the key in flight in this process      429 rate_limit_exceeded
    rpm          token bucket of ``rpm`` requests, refilled rpm/60 per second
    tpm          token bucket of ``tpm`` tokens, refilled tpm/60 per second; a request takes
                 its reservation, and ``settle`` corrects the bucket by what it really used
    quota        the period's consumed tokens (``UsageRecorder.period_tokens``) plus this
                 process's open reservations plus this one must fit       429 insufficient_quota

Every refusal carries ``retry_after_s``: when the bucket will hold enough, 1 s for
concurrency, the start of the next period for a quota. A bucket starts full, so a key may
burst its whole minute's allowance at once and then gets the steady rate.

The limits are per process: N gateways give a key up to N times its rpm, tpm and
concurrency. Quotas are shared through Postgres (how far they can overshoot is in
``accounting``'s docstring). A request whose reservation alone is over the key's tpm can
never pass and is refused with a message saying to lower ``max_tokens``.

What this module must NOT do: I/O. It is called on the request path, once per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.gateway.accounting import UsageRecorder, period_bounds
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.keys import KeyContext
from llmgw.ratelimit import TokenBucket

__all__ = ["AdmittedRequest", "Limiter"]

_MINUTE_S = 60.0
# A refused concurrency slot frees when some request ends; clients should come back soon.
_CONCURRENCY_RETRY_S = 1.0


@dataclass(slots=True)
class _KeyState:
    in_flight: int = 0
    # Tokens reserved by admitted, unsettled requests (counted against the quota).
    reserved: int = 0
    rpm: TokenBucket | None = None
    tpm: TokenBucket | None = None
    admitted: int = 0


class Limiter:
    """Per-key limit state for this process; ``clock`` is monotonic seconds for the rate
    buckets, ``wall_clock`` wall-clock seconds for quota periods."""

    def __init__(
        self,
        *,
        recorder: UsageRecorder,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._recorder = recorder
        self._clock = clock
        self._wall_clock = wall_clock
        self._keys: dict[str, _KeyState] = {}

    def in_flight(self, key_id: str) -> int:
        state = self._keys.get(key_id)
        return 0 if state is None else state.in_flight

    def reserved(self, key_id: str) -> int:
        state = self._keys.get(key_id)
        return 0 if state is None else state.reserved

    def admit(self, key: KeyContext, model: str, reserve_tokens: int) -> AdmittedRequest:
        """Admit one request that may use up to ``reserve_tokens`` (prompt + completion);
        raises ``GatewayError`` (429) naming the limit it would break."""
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must not be negative (got {reserve_tokens})")
        now = self._clock()
        state = self._keys.get(key.key_id)
        if state is None:
            state = self._keys[key.key_id] = _KeyState()

        if key.concurrency is not None and state.in_flight >= key.concurrency:
            raise GatewayError.rate_limited(
                f"key {key.name!r} has {state.in_flight} requests in flight, its concurrency "
                f"limit is {key.concurrency}",
                _CONCURRENCY_RETRY_S,
            )
        rpm = None
        if key.rpm is not None:
            rpm = state.rpm = _per_minute(state.rpm, key.rpm)
            if rpm.refill(now) < 1.0:
                raise GatewayError.rate_limited(
                    f"key {key.name!r} allows {key.rpm} requests per minute", rpm.wait_s(1.0)
                )
        tpm = None
        if key.tpm is not None:
            if reserve_tokens > key.tpm:
                raise GatewayError.rate_limited(
                    f"this request may use {reserve_tokens} tokens (prompt + max_tokens), more "
                    f"than key {key.name!r} allows per minute ({key.tpm}); lower max_tokens",
                    _MINUTE_S,
                )
            tpm = state.tpm = _per_minute(state.tpm, key.tpm)
            if tpm.refill(now) < reserve_tokens:
                raise GatewayError.rate_limited(
                    f"key {key.name!r} allows {key.tpm} tokens per minute and this request may "
                    f"use {reserve_tokens}",
                    tpm.wait_s(reserve_tokens),
                )
        if key.token_quota is not None and key.quota_period is not None:
            wall = self._wall_clock()
            used = self._recorder.period_tokens(key.key_id, key.quota_period, wall)
            if used + state.reserved + reserve_tokens > key.token_quota:
                left = max(0, key.token_quota - used - state.reserved)
                raise GatewayError.insufficient_quota(
                    f"key {key.name!r} has {left} of its {key.token_quota} tokens per "
                    f"{key.quota_period} left and this request may use {reserve_tokens}",
                    period_bounds(wall, key.quota_period)[1] - wall,
                )

        state.in_flight += 1
        state.admitted += 1
        state.reserved += reserve_tokens
        if rpm is not None:
            rpm.take(1.0)
        if tpm is not None:
            tpm.take(reserve_tokens)
        return AdmittedRequest(self, key, model, reserve_tokens)

    # --- called by AdmittedRequest -------------------------------------------

    def _settle(self, adm: AdmittedRequest, used: int, *, holds_reservation: bool) -> None:
        state = self._keys[adm.key.key_id]
        reserved = adm.reserve_tokens if holds_reservation else 0
        if holds_reservation:
            state.reserved -= reserved
        if state.tpm is not None and adm.key.tpm is not None:
            # What the request really used replaces what it reserved; the level may go below
            # zero when it used more, and the next requests wait for that.
            tpm = _per_minute(state.tpm, adm.key.tpm)
            tpm.refill(self._clock())
            tpm.credit(reserved - used)

    def _release(self, adm: AdmittedRequest, *, holds_reservation: bool) -> None:
        state = self._keys[adm.key.key_id]
        state.in_flight -= 1
        if holds_reservation:
            self._settle(adm, 0, holds_reservation=True)


def _per_minute(bucket: TokenBucket | None, per_minute: int) -> TokenBucket:
    """The key's bucket at its limit as it stands: a key starts with a full minute's allowance,
    and an edited limit applies from the next refill (the key cache hands the new one)."""
    if bucket is None:
        return TokenBucket(rate_per_s=per_minute / _MINUTE_S, burst=per_minute)
    bucket.rate_per_s = per_minute / _MINUTE_S
    bucket.burst = float(per_minute)
    return bucket


class AdmittedRequest:
    """One admitted request: ``settle`` it with its usage when it ends (a client that went
    away mid-stream is settled with what was streamed), and ``release`` it in a ``finally``
    (or use it as a context manager). Both are idempotent."""

    __slots__ = ("_limiter", "_released", "_settled", "key", "model", "reserve_tokens")

    def __init__(self, limiter: Limiter, key: KeyContext, model: str, reserve_tokens: int):
        self._limiter = limiter
        self.key = key
        self.model = model
        self.reserve_tokens = reserve_tokens
        self._settled = False
        self._released = False

    def settle(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """Record the request's usage and replace its reservation with it. Once only: a
        second call records nothing."""
        if self._settled:
            return
        self._settled = True
        self._limiter._settle(
            self, prompt_tokens + completion_tokens, holds_reservation=not self._released
        )
        self._limiter._recorder.record(
            self.key.key_id,
            self.model,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        )

    def release(self) -> None:
        """Free the concurrency slot; an unsettled reservation is given back (the request
        used nothing: it failed before any token)."""
        if self._released:
            return
        self._released = True
        self._limiter._release(self, holds_reservation=not self._settled)

    def __enter__(self) -> AdmittedRequest:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()
