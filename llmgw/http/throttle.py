"""The one throttle on guessing a secret: failed credential checks cost the client that made them.

Before it the console's sign-in limiter answered 429 only to wrong guesses (a right token still
signed in while "limited", so it slowed nothing: 746 guesses/s), and nothing at all slowed
admin Bearer guesses (~2,000/s), though an admin token may be 16 characters.

So, per client (its peer address; an IPv6 client by its /64, the block one holder usually
has): failures take from a token bucket (``llmgw.ratelimit``), and while a client's bucket is
empty EVERY attempt from it is refused (429 with Retry-After) before any secret is compared,
the right one included: a refused guess learns nothing, so guessing is bounded by the bucket's
rate whatever the guesser sends. Each failure also costs its caller ``failure_delay_s`` (an
``asyncio.sleep``: the loop serves others meanwhile), which slows a guesser that waits for
its answers. A right credential forgives the client's failures (who holds the secret needs
no guessing) and marks the client as known.

One global bucket too: many addresses together guess at most its rate. While it is empty,
clients not known are refused, known clients (a right credential seen from them while they
were tracked) still try, so a guesser spread over many addresses cannot lock the operator out.

Memory is bounded: at most ``max_clients`` are tracked, the least recently seen dropped first,
known clients last (an attacker churning addresses evicts only its own kind: the global bucket
still bounds its guesses, and the operator it would lock out stays known). The address is the
TCP peer's (the listeners do not read X-Forwarded-For): behind a proxy every client has the
proxy's address, one budget for all, which fails safe.

What it must not do: compare a secret (its callers do, between ``refused`` and ``failed`` /
``succeeded``, with no ``await`` in between so concurrent guesses cannot all pass one check),
or log a credential.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from llmgw.errors import retry_after
from llmgw.ratelimit import TokenBucket

# retry_after is the tree's one Retry-After spelling, named here for the throttle's callers
# (the console's sign-in, whose package does not import llmgw.errors).
__all__ = ["AuthThrottle", "client_key", "retry_after"]

log = structlog.get_logger("llmgw.auth")

# One client's failures: a burst of typos, then one guess every 5 s (12 a minute).
CLIENT_BURST = 10
CLIENT_RATE_PER_S = 0.2
# All clients' failures together: a few clients' bursts, then 2 guesses a second.
GLOBAL_BURST = 50
GLOBAL_RATE_PER_S = 2.0
# What each failure costs its caller before the answer.
FAILURE_DELAY_S = 0.2
# Clients tracked at most (each a few hundred bytes).
MAX_CLIENTS = 4096


def client_key(scope: Mapping[str, Any]) -> str:
    """The client an ASGI ``scope`` came from, as the throttle counts it: the peer's address,
    an IPv6 one by its /64; "unknown" for a peer without one (all such share one budget)."""
    client = scope.get("client")
    host = str(client[0]) if client else ""
    if not host:
        return "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # a test transport's name ("testclient")
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _Client:
    __slots__ = ("bucket", "known")

    def __init__(self, bucket: TokenBucket) -> None:
        self.bucket = bucket
        self.known = False


class AuthThrottle:
    """Failed credential checks per client and overall; see the module's docstring."""

    def __init__(
        self,
        *,
        client_burst: float = CLIENT_BURST,
        client_rate_per_s: float = CLIENT_RATE_PER_S,
        global_burst: float = GLOBAL_BURST,
        global_rate_per_s: float = GLOBAL_RATE_PER_S,
        failure_delay_s: float = FAILURE_DELAY_S,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_clients < 1:
            raise ValueError("max_clients must be >= 1")
        self.client_burst = client_burst
        self.client_rate_per_s = client_rate_per_s
        self.failure_delay_s = failure_delay_s
        self.max_clients = max_clients
        self.clock = clock
        self.overall = TokenBucket(rate_per_s=global_rate_per_s, burst=global_burst)
        self._clients: OrderedDict[str, _Client] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def refused(self, client: str) -> float | None:
        """Seconds ``client`` must wait before its next attempt is compared (a 429's
        Retry-After); None: let it try. Call it before comparing, and again right before
        comparing when an ``await`` (reading a form) came between."""
        now = self.clock()
        entry = self._clients.get(client)
        if entry is not None:
            self._clients.move_to_end(client)
            if entry.bucket.refill(now) < 1.0:
                return entry.bucket.wait_s(1.0)
            if entry.known:
                return None
        if self.overall.refill(now) < 1.0:
            return self.overall.wait_s(1.0)
        return None

    def record_failure(self, client: str) -> None:
        """A wrong credential from ``client``: one from its budget and one from the global."""
        now = self.clock()
        entry = self._entry(client)
        entry.bucket.refill(now)
        entry.bucket.take(1.0)
        self.overall.refill(now)
        self.overall.take(1.0)
        if entry.bucket.level < 1.0 <= entry.bucket.level + 1.0:
            # Once per crossing, not per refusal: a flood of refusals writes no flood of lines.
            log.warning(
                "auth_failures_throttled",
                client=client,
                retry_after_s=round(entry.bucket.wait_s(1.0), 1),
                why="too many wrong credentials: every attempt is refused until the wait ends",
            )

    async def failed(self, client: str) -> None:
        """``record_failure``, then the failure's delay (recorded first: concurrent guesses
        each see the ones before them)."""
        self.record_failure(client)
        if self.failure_delay_s > 0:
            await asyncio.sleep(self.failure_delay_s)

    def succeeded(self, client: str) -> None:
        """A right credential from ``client``: its failures forgiven, the client known."""
        entry = self._entry(client)
        entry.bucket.level = entry.bucket.burst
        entry.known = True

    def _entry(self, client: str) -> _Client:
        entry = self._clients.get(client)
        if entry is None:
            entry = _Client(TokenBucket(rate_per_s=self.client_rate_per_s, burst=self.client_burst))
            self._clients[client] = entry
            if len(self._clients) > self.max_clients:
                self._evict(keep=client)
        else:
            self._clients.move_to_end(client)
        return entry

    def _evict(self, *, keep: str) -> None:
        """Drop the least recently seen client not known (never ``keep``, the one just added);
        a known one only when all others are. Only a right credential makes a client known,
        so a guesser cannot lengthen the scan past the known ones."""
        for key, entry in self._clients.items():
            if not entry.known and key != keep:
                del self._clients[key]
                return
        self._clients.popitem(last=False)
