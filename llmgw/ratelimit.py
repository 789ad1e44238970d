"""The one token bucket: the gateway's per-key rates (``gateway.limits``: rpm and tpm) and its
retry budget (``gateway.load.RetryBudget``), and the control plane's rationing (the agent
API's full KV copies and unknown-node lookups, the console's sign-in failures) are each one.

A bucket holds at most ``burst`` tokens, starts full, and refills at ``rate_per_s`` (0: only
by ``credit``, as the retry budget is filled by requests, not by time). ``admit``
is the common case (take ``amount`` if it is there, else say when it will be); ``refill``,
``take`` and ``credit`` are its parts, for a caller that checks several buckets before it takes
from any (``Limiter.admit``), takes more than it has (the level may go below zero, and later
takes wait for that) or gives back what a reservation did not use.

Pure: the caller passes ``now`` (its monotonic clock, in seconds) in; nothing here reads a
clock, and no state is shared between buckets.
"""

from __future__ import annotations

import math

__all__ = ["TokenBucket"]


class TokenBucket:
    """``rate_per_s`` tokens sustained, ``burst`` at once."""

    __slots__ = ("_at", "burst", "level", "rate_per_s")

    def __init__(self, *, rate_per_s: float, burst: float) -> None:
        if rate_per_s < 0 or burst < 1:
            raise ValueError("a token bucket needs rate_per_s >= 0 and burst >= 1")
        self.rate_per_s = float(rate_per_s)
        self.burst = float(burst)
        self.level = float(burst)
        self._at: float | None = None  # when it was last refilled; None: never, it is full

    def refill(self, now: float) -> float:
        """The level at ``now``, what accrued since the last refill added (at most ``burst``)."""
        if self._at is not None:
            self.level = min(self.burst, self.level + (now - self._at) * self.rate_per_s)
        self._at = now
        return self.level

    def wait_s(self, amount: float = 1.0) -> float:
        """Seconds from the last refill until the level reaches ``amount`` (0.0: it does; inf:
        time alone never refills it)."""
        if self.level >= amount:
            return 0.0
        return (amount - self.level) / self.rate_per_s if self.rate_per_s > 0 else math.inf

    def take(self, amount: float = 1.0) -> None:
        """Take ``amount`` whatever the level (it may go below zero)."""
        self.level -= amount

    def credit(self, amount: float) -> None:
        """Give ``amount`` back (negative: take it), the level still at most ``burst``."""
        self.level = min(self.burst, self.level + amount)

    def admit(self, now: float, amount: float = 1.0) -> float | None:
        """Take ``amount`` at ``now`` if the bucket holds it and return None; else take nothing
        and return the seconds until it will (what a 429's Retry-After says)."""
        if self.refill(now) >= amount:
            self.level -= amount
            return None
        return self.wait_s(amount)
