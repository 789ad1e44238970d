"""Replica load and passive health, as the router reads them.

Load of a replica, in requests = this gateway's in-flight requests to it + the others its
engine reports (running + waiting, scraped from the engine's /metrics through the shard's front
door every ``scrape_s``, less this gateway's own in-flight at that scrape). Which metrics say
running and waiting is the engine's to know: its adapter's ``Engine.load_metrics``, carried on
each replica's route (``Endpoint.load_metrics``); this module spells no engine's names. The
in-flight count is exact and immediate; the scrape adds what other gateways sent. Between two
scrapes a burst from this gateway is seen through its in-flight count, so a burst is not piled
on one replica waiting for the next scrape.

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
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from llmgw.engines import LoadMetrics
from llmgw.gateway.pool import read_capped
from llmgw.gateway.routes import Endpoint
from llmgw.logs import get_logger
from llmgw.periodic import Periodic
from llmgw.ratelimit import TokenBucket

__all__ = [
    "EngineLoad",
    "LoadTracker",
    "RetryBudget",
    "parse_engine_load",
    "parse_max_model_len",
]

log = get_logger("llmgw.gateway")

# An engine's /metrics (vLLM's, with every histogram, is ~100-300 KB) or /v1/models; more is
# not one, and is not read.
_SCRAPE_MAX_BYTES = 4 * 2**20
# Weight of each new request in the running mean of prefill per request (~the last 20).
_MEAN_WEIGHT = 0.05


class EngineLoad(NamedTuple):
    """What an engine's /metrics said: requests running + waiting, and waiting alone (its own
    queue: what a KEDA rule on vLLM scales on, the autoscaler's demand rows)."""

    load: int
    waiting: int


def parse_engine_load(body: bytes, names: LoadMetrics) -> EngineLoad:
    """Running + waiting and waiting from a Prometheus text exposition, each metric summed over
    its label sets; ``names``: the engine's (``Endpoint.load_metrics``).

    The samples are read by ``prometheus_client``'s parser, but only from the lines that start
    with one of ``names``: the parser takes 18-83 ms over a whole vLLM exposition (63-178 KB of
    histograms, one to four engine ranks), this 0.1-0.6 ms, and a scrape runs on the event loop
    every ``load_scrape_s`` for every replica."""
    running = waiting = 0.0
    for sample in _samples(_lines(body, (*names.running, *names.waiting))):
        if not math.isfinite(sample.value):
            continue  # NaN or Inf says nothing of a count
        if sample.name in names.running:
            running += sample.value
        elif sample.name in names.waiting:
            waiting += sample.value
    return EngineLoad(int(running + waiting), int(waiting))


def _lines(body: bytes, names: Iterable[str]) -> list[bytes]:
    """The lines of ``body`` that start with one of ``names`` (a longer name that starts with
    one too is left to the parser's exact name); found with ``bytes.find``, never a split of
    the whole body."""
    out: list[bytes] = []
    for name in names:
        needle = name.encode()
        at = body.find(needle)
        while at != -1:
            end = body.find(b"\n", at)
            end = len(body) if end == -1 else end
            if at == 0 or body[at - 1] == 0x0A:  # at a line's start, not in a comment
                out.append(body[at:end])
            at = body.find(needle, end)
    return out


def _samples(lines: list[bytes]) -> Iterator[Sample]:
    """The samples of ``lines``; a line the parser refuses is skipped, the others still read."""
    if not lines:
        return
    try:
        text = b"\n".join(lines).decode(errors="replace") + "\n"
        families = list(text_string_to_metric_families(text))
    except ValueError:
        families = []
        for line in lines:
            with contextlib.suppress(ValueError):
                text = line.decode(errors="replace") + "\n"
                families.extend(text_string_to_metric_families(text))
    for family in families:
        yield from family.samples


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
        self._scraper: Periodic | None = None

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
                got = parse_engine_load(metrics, ep.load_metrics)
                self.observed(ep.replica, got.load)
                self.waiting[ep.replica] = got.waiting

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

        async def scrape() -> None:
            await self.scrape(http, endpoints())

        def failed(exc: Exception, _failures: int) -> None:
            # The next period scrapes again: routing falls back to in-flight meanwhile.
            log.warning("gateway_scrape_failed", error=repr(exc))

        self._scraper = Periodic(
            scrape,
            name="gateway-load-scrape",
            interval_s=period_s,
            run_at_start=True,
            on_error=failed,
        )
        self._scraper.start()

    async def stop(self) -> None:
        if self._scraper is not None:
            await self._scraper.stop()
        self._scraper = None


class RetryBudget:
    """Retries rationed by a token bucket filled by requests, not by time: every request
    deposits ``ratio`` of a token, a retry takes one, the bucket holds at most ``burst``. When
    a whole fleet fails, retries stop at ``ratio`` of the traffic instead of doubling the load
    on what is left of it."""

    def __init__(self, *, ratio: float, burst: float = 10.0) -> None:
        self.ratio = ratio
        self._bucket = TokenBucket(rate_per_s=0.0, burst=burst)
        if ratio <= 0:
            self._bucket.take(burst)  # no retries at all: it starts empty and stays so

    def deposit(self) -> None:
        self._bucket.credit(self.ratio)

    def withdraw(self) -> bool:
        if self._bucket.level >= 1.0:
            self._bucket.take(1.0)
            return True
        return False
