"""Replica load and passive health, as the router reads them.

Load of a replica, in requests = this gateway's in-flight requests to it + the others its
engine reports (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``, scraped from the
engine's /metrics through the shard's front door every ``scrape_s``, less this gateway's own
in-flight at that scrape; the simulator exports the same names, and llama-server says
``llamacpp:requests_processing`` + ``llamacpp:requests_deferred``). The in-flight count is
exact and immediate; the scrape adds what other gateways sent. Between two scrapes a burst
from this gateway is seen through its in-flight count, so a burst is not piled on one replica
waiting for the next scrape.

Work of a replica, in prompt tokens = the prefill still queued there: each of this gateway's
requests counts the part of its prompt the engine must compute (its length less the share
the router found held) until its first token arrives; each request of another gateway counts
the mean of this gateway's recent requests (an engine reports counts, not tokens). The router
weighs work against recomputing a prompt (router.py).

Passive health: ``eject_after`` consecutive failures (connection errors, 5xx before a header)
eject a replica for ``eject_for_s``; any success resets the count. Ejected replicas are not
candidates, unless every replica is ejected (then all are: a guess beats a certain 503).

What it must NOT do: block a request on a scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from llmgw.eventloop import cancel_and_wait
from llmgw.gateway.pool import read_capped
from llmgw.gateway.routes import Endpoint
from llmgw.logs import get_logger

__all__ = [
    "LoadTracker",
    "RetryBudget",
    "parse_engine_load",
    "parse_engine_waiting",
    "parse_max_model_len",
]

log = get_logger("llmgw.gateway")

# An engine's /metrics (vLLM's, with every histogram, is ~100-300 KB) or /v1/models; more is
# not one, and is not read.
_SCRAPE_MAX_BYTES = 4 * 2**20
# Running + waiting, in each engine's own names (llama-server's seen on the build
# docs/engines.md names).
_LOAD_METRICS = (
    b"vllm:num_requests_running",
    b"vllm:num_requests_waiting",
    b"llamacpp:requests_processing",
    b"llamacpp:requests_deferred",
)
_LOAD_PREFIXES = (b"vllm:num_requests_", b"llamacpp:requests_")
# Weight of each new request in the running mean of prefill per request (~the last 20).
_MEAN_WEIGHT = 0.05


def parse_engine_load(body: bytes) -> int:
    """running + waiting from a Prometheus text exposition (summed over label sets)."""
    total = 0.0
    for line in body.splitlines():
        if not line.startswith(_LOAD_PREFIXES):
            continue
        for name in _LOAD_METRICS:
            if line.startswith(name) and line[len(name) : len(name) + 1] in (b"{", b" "):
                with contextlib.suppress(ValueError, IndexError):
                    total += float(line.rsplit(None, 1)[1])
    return int(total)


# Waiting only (the engine's own queue: what a KEDA rule on vLLM scales on), summed too.
_WAITING_METRICS = (b"vllm:num_requests_waiting", b"llamacpp:requests_deferred")


def parse_engine_waiting(body: bytes) -> int:
    """waiting alone from a Prometheus text exposition (summed over label sets)."""
    total = 0.0
    for line in body.splitlines():
        for name in _WAITING_METRICS:
            if line.startswith(name) and line[len(name) : len(name) + 1] in (b"{", b" "):
                with contextlib.suppress(ValueError, IndexError):
                    total += float(line.rsplit(None, 1)[1])
    return int(total)


def parse_max_model_len(body: bytes) -> int | None:
    """The context length a replica serves, from its ``GET /v1/models`` (vLLM and the
    simulator state ``max_model_len`` on every entry; adapters share their base's)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    limits = []
    for entry in data if isinstance(data, list) else ():
        value = entry.get("max_model_len") if isinstance(entry, dict) else None
        if type(value) is int and value > 0:
            limits.append(value)
    return min(limits) if limits else None


@dataclass(slots=True)
class _Health:
    failures: int = 0
    ejected_until: float = 0.0


class LoadTracker:
    def __init__(
        self,
        *,
        eject_after: int,
        eject_for_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.eject_after = eject_after
        self.eject_for_s = eject_for_s
        self._clock = clock
        self.in_flight: dict[str, int] = {}
        # replica -> what its engine reported running + waiting, and this gateway's in-flight
        # when it did (so its own requests are not counted twice).
        self.engine: dict[str, int] = {}
        self._own_at_scrape: dict[str, int] = {}
        # replica -> prompt tokens of this gateway's requests not yet past their prefill.
        self.prefill: dict[str, float] = {}
        # replica -> what its engine reported waiting alone (the autoscaler's demand rows).
        self.waiting: dict[str, int] = {}
        self.mean_prefill = 0.0  # prompt tokens per request of ours, a running mean
        # replica -> its context length (max_model_len), asked once per replica.
        self.context: dict[str, int] = {}
        self._health: dict[str, _Health] = {}
        # replica -> clock() of its last scrape answered: it is alive (busy is not broken).
        self._scraped_at: dict[str, float] = {}
        self._period_s = 0.5
        self._task: asyncio.Task[None] | None = None

    def others(self, replica: str) -> int:
        """Requests on the replica that other gateways sent, as of the last scrape."""
        return max(0, self.engine.get(replica, 0) - self._own_at_scrape.get(replica, 0))

    def load(self, replica: str) -> int:
        return self.in_flight.get(replica, 0) + self.others(replica)

    def work(self, replica: str) -> float:
        return self.prefill.get(replica, 0.0) + self.others(replica) * self.mean_prefill

    def started(self, replica: str, prefill: float = 0.0) -> None:
        """A request was sent; ``prefill``: the prompt tokens it makes the engine compute."""
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        if prefill > 0:
            self.prefill[replica] = self.prefill.get(replica, 0.0) + prefill
        self.mean_prefill += _MEAN_WEIGHT * (prefill - self.mean_prefill)

    def prefilled(self, replica: str, prefill: float) -> None:
        """The request's first token arrived: its prefill no longer queues anyone."""
        if prefill <= 0:
            return
        left = self.prefill.get(replica, 0.0) - prefill
        if left > 0.5:
            self.prefill[replica] = left
        else:
            self.prefill.pop(replica, None)

    def finished(self, replica: str, prefill: float = 0.0) -> None:
        """The request ended; ``prefill``: what of it was not yet counted off as prefilled."""
        self.prefilled(replica, prefill)
        left = self.in_flight.get(replica, 0) - 1
        if left > 0:
            self.in_flight[replica] = left
        else:
            self.in_flight.pop(replica, None)

    def context_limit(self, replicas: Iterable[str]) -> int | None:
        """The smallest context length known among ``replicas`` (None: none known yet)."""
        known = [self.context[r] for r in replicas if r in self.context]
        return min(known) if known else None

    def healthy(self, replica: str) -> bool:
        h = self._health.get(replica)
        return h is None or h.ejected_until <= self._clock()

    def failures(self, replica: str) -> int:
        """Consecutive failures not yet ejecting it (a retry prefers replicas without)."""
        h = self._health.get(replica)
        return 0 if h is None else h.failures

    def succeeded(self, replica: str) -> None:
        h = self._health.get(replica)
        if h is not None:
            h.failures = 0

    def failed(self, replica: str) -> bool:
        """Count a failure; True when it ejected the replica."""
        h = self._health.setdefault(replica, _Health())
        h.failures += 1
        if h.failures >= self.eject_after:
            h.failures = 0
            h.ejected_until = self._clock() + self.eject_for_s
            log.warning("gateway_replica_ejected", replica=replica, for_s=self.eject_for_s)
            return True
        return False

    # --- scraping ----------------------------------------------------------------------

    def alive(self, replica: str) -> bool:
        """Whether the replica's engine answered a scrape within the last few periods."""
        at = self._scraped_at.get(replica)
        return at is not None and self._clock() - at <= max(5.0, 4 * self._period_s)

    def observed(self, replica: str, engine_load: int) -> None:
        """The engine reported ``engine_load`` requests running + waiting, ours among them."""
        self._scraped_at[replica] = self._clock()
        self.engine[replica] = engine_load
        self._own_at_scrape[replica] = self.in_flight.get(replica, 0)

    async def scrape(self, http: aiohttp.ClientSession, endpoints: Iterable[Endpoint]) -> None:
        eps = list(endpoints)

        async def fetch(ep: Endpoint, path: str) -> bytes | None:
            """The body of a 200, else None: passive health judges requests, and a missed
            scrape keeps the last value."""
            try:
                async with http.get(
                    f"{ep.url}{path}",
                    headers={"Authorization": f"Bearer {ep.api_key}"},
                    timeout=aiohttp.ClientTimeout(total=1.0),
                ) as resp:
                    return (
                        await read_capped(resp, _SCRAPE_MAX_BYTES) if resp.status == 200 else None
                    )
            except (aiohttp.ClientError, TimeoutError):
                return None

        async def one(ep: Endpoint) -> None:
            if ep.replica not in self.context:
                models = await fetch(ep, "/v1/models")
                limit = parse_max_model_len(models) if models is not None else None
                if limit is not None:
                    self.context[ep.replica] = limit
            metrics = await fetch(ep, "/metrics")
            if metrics is not None:
                self.observed(ep.replica, parse_engine_load(metrics))
                self.waiting[ep.replica] = parse_engine_waiting(metrics)

        await asyncio.gather(*(one(ep) for ep in eps))
        live = {ep.replica for ep in eps}
        for gone in [r for r in self.waiting if r not in live]:
            del self.waiting[gone]
        for gone in [r for r in self.engine if r not in live]:
            del self.engine[gone]
            self._own_at_scrape.pop(gone, None)
            self._scraped_at.pop(gone, None)
        for gone in [r for r in self.context if r not in live]:
            del self.context[gone]

    async def start(
        self,
        http: aiohttp.ClientSession,
        endpoints: Callable[[], Iterable[Endpoint]],
        period_s: float,
    ) -> None:
        self._period_s = period_s

        async def run() -> None:
            while True:
                try:
                    await self.scrape(http, endpoints())
                except Exception as exc:  # never let the loop die: routing falls back to in-flight
                    log.warning("gateway_scrape_failed", error=repr(exc))
                await asyncio.sleep(period_s)

        self._task = asyncio.create_task(run(), name="gateway-load-scrape")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None


class RetryBudget:
    """A token bucket for retries: every request deposits ``ratio`` of a token, a retry takes
    one, the bucket holds at most ``burst``. When a whole fleet fails, retries stop at
    ``ratio`` of the traffic instead of doubling the load on what is left of it."""

    def __init__(self, *, ratio: float, burst: float = 10.0) -> None:
        self.ratio = ratio
        self.burst = burst
        self._tokens = burst if ratio > 0 else 0.0

    def deposit(self) -> None:
        self._tokens = min(self.burst, self._tokens + self.ratio)

    def withdraw(self) -> bool:
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
