"""The upstream side of the request path: the pooled session to the replicas' agent proxies,
sending a request to a replica, and the retry rule.

Retries: only when the connection to the replica could not be made (directly, or as the agent's
proxy reports it: 502 ``upstream-unavailable``, or 404 ``not-found`` for a shard it no longer
serves) or the replica answered 503 before any header; at most once, to another replica (one
without recent failures first), within a retry budget (a token bucket filled by
``gateway.retry_budget_ratio`` per request). Anything else is not retried: the engine may have
started the work.

Every request is counted on its replica from before it is sent until it ends (``LoadTracker``:
in flight, and its prefill until the first token), and its ``Claim`` held in the ``computing``
tree meanwhile; an attempt that failed to connect leaves no claim (the replica most likely holds
none of it).

Busy is not broken: a refused or reset connection, or a 503, from a replica that reports
itself alive (its /metrics scraped lately) and loaded (running + waiting at least half its
admission limit) halves its admission limit (``admission``) instead of counting toward its
ejection; the retry rule is the same. When no retry is left, a busy refusal is ``Busy`` (the
app sheds it: 503 with Retry-After), never a 502. Only failures at low load eject.

What it must NOT do: follow redirects or decompress (``pool``), retry a request that may have
reached an engine, or let a count leak when a request is cancelled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from llmgw.config import GatewaySettings
from llmgw.gateway.errors import adapter_not_loaded, upstream_failed
from llmgw.gateway.load import LoadTracker, RetryBudget
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.pool import create_client, read_capped
from llmgw.gateway.routes import Endpoint, ModelRoute
from llmgw.gateway.routing.admission import AdmissionWindows
from llmgw.gateway.routing.approx import ApproxTree
from llmgw.gateway.routing.inputs import Claim
from llmgw.logs import get_logger

__all__ = ["Attempt", "Busy", "Upstream", "engine_said"]

log = get_logger("llmgw.gateway")


class Busy(Exception):
    """The replica (and any retry's) refused or reset the request while busy: shed, not a
    fault."""


@dataclass(slots=True)
class Attempt:
    """A request a replica accepted: its answer's headers are in."""

    ep: Endpoint
    resp: aiohttp.ClientResponse
    prefill: float  # prompt tokens the replica computes, counted as its work until the 1st token
    claim: Claim | None  # the prompt's claim in the ``computing`` tree, until the 1st token
    # The answer's body when it was read already (a 404 or 502 read to tell the agent's proxy
    # from the engine): ``resp`` has none left, and the engine's own answer is this.
    body: bytes | None = None


# The agent proxy's answers that mean "the request never reached an engine": it could not
# connect to it (502), or it no longer serves the shard (404, a route table a moment stale).
# They are the proxy's spelling of a connection error, retried like one.
_PROXY_UNREACHED = {502: "upstream-unavailable", 404: "not-found"}
# The proxy's error bodies are a few hundred bytes; a bigger one is not the proxy's.
_PROXY_ERROR_MAX_BYTES = 64 * 1024
# The proxy's answers that mean "the engine was reached but did not answer": it broke
# mid-request while still listening (a crash under way) or stayed silent past the timeout.
# Transient: the client may retry. (HTTP's own "an intermediary failed" statuses read so too.)
_PROXY_FAILED = frozenset({"upstream-failed", "upstream-timeout", "upstream-unavailable"})
_INTERMEDIARY_STATUSES = frozenset({502, 503, 504})
_MESSAGE_MAX_BYTES = 512  # of a plain-text 5xx body quoted (the error quotes 200 characters)


class Upstream:
    """The session to the replicas (``open`` at start, ``close`` at the end) and the requests
    sent over it, counted in ``load`` and claimed in ``computing``."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        load: LoadTracker,
        computing: ApproxTree,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        windows: AdmissionWindows | None = None,
    ) -> None:
        self._settings = settings
        self._windows = windows or AdmissionWindows()
        self._load = load
        self._computing = computing
        self._metrics = metrics
        self._clock = clock
        self.budget = RetryBudget(ratio=settings.retry_budget_ratio)
        self._http: aiohttp.ClientSession | None = None

    def open(self) -> aiohttp.ClientSession:
        """Create the pooled session (the load scrape and the tokenizer share it)."""
        s = self._settings
        self._http = create_client(
            pool_size=s.upstream_pool_size,
            connect_timeout_s=s.upstream_connect_timeout_s,
            read_timeout_s=s.upstream_read_timeout_s,
        )
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    def candidates(self, route: ModelRoute, exclude: Sequence[str]) -> list[Endpoint]:
        """The route's endpoints but ``exclude``, the ejected ones left out unless all are."""
        eps = [ep for ep in route.endpoints if ep.replica not in exclude]
        healthy = [ep for ep in eps if self._load.healthy(ep.replica)]
        return healthy or eps

    async def send(
        self,
        route: ModelRoute,
        replica: str,
        payload: bytes,
        path: str,
        *,
        prefill: float,
        prompt_tokens: int,
        claim: Claim | None = None,
        method: str = "POST",
        pinned: bool = False,
    ) -> Attempt:
        """Send to ``replica``, retried once elsewhere on a connection error or a 503 before
        any header. ``prefill``: what of the prompt ``replica`` computes (a retry's replica
        is taken to compute all ``prompt_tokens``). ``pinned``: only ``replica`` can answer
        (it stores the response the request names), never retried elsewhere."""
        assert self._http is not None
        load = self._load
        ep = next(e for e in route.endpoints if e.replica == replica)
        tried: list[str] = []
        while True:
            tried.append(ep.replica)
            why: str
            # Counted from before the request is sent: a non-streamed answer's headers come
            # only when it is complete, and the replica is busy with it all along.
            load.started(ep.replica, prefill)
            if claim is not None:
                self._computing.record(*claim, ep.replica, now=math.inf)
            try:
                resp = await self._http.request(
                    method,
                    ep.url + path,
                    data=payload,
                    headers={
                        "Authorization": f"Bearer {ep.api_key}",
                        "Content-Type": "application/json",
                    },
                    allow_redirects=False,
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                self.ended(ep.replica, prefill, claim, computed=False)
                why, kind = "connection refused, unreachable or timed out", "connect"
            except (aiohttp.ClientError, TimeoutError) as exc:
                # The request may have reached the engine: never retried (it may be running).
                self.ended(ep.replica, prefill, claim, computed=False)
                kind = "timeout" if isinstance(exc, TimeoutError) else "disconnect"
                if kind == "disconnect" and self._busy(ep):
                    raise Busy(ep.replica) from None
                self.failed(route, ep, kind)
                raise upstream_failed(route.name, type(exc).__name__) from None
            except BaseException:  # cancelled: the count must not leak
                self.ended(ep.replica, prefill, claim)
                raise
            else:
                try:
                    unreached, body = await _proxy_unreached(resp)
                except BaseException:
                    resp.release()
                    self.ended(ep.replica, prefill, claim)
                    raise
                # A runtime adapter's 404 from the engine itself: it no longer (or not yet)
                # holds the adapter the route table said it loaded (an unload lands before the
                # agent's next report). The request never ran: another holder may take it.
                not_loaded = resp.status == 404 and unreached is None and route.runtime
                if resp.status != 503 and unreached is None and not not_loaded:
                    load.succeeded(ep.replica)
                    self._windows.succeeded(ep.replica)
                    return Attempt(ep, resp, prefill, claim, body)
                resp.release()
                self.ended(ep.replica, prefill, claim, computed=False)
                why = unreached or "the replica answered 503"
                kind = "adapter" if not_loaded else "connect" if unreached else "status"
            busy = False if kind == "adapter" else self._busy(ep)
            if not busy and kind != "adapter":  # a replica without the adapter is healthy
                self.failed(route, ep, kind)
            others = [] if pinned else self.candidates(route, exclude=tried)
            if len(tried) > 1 or not others or not self.budget.withdraw():
                if busy:
                    raise Busy(ep.replica)
                if kind == "adapter":
                    log.info("gateway_adapter_not_loaded", adapter=route.name, replica=ep.replica)
                    raise adapter_not_loaded(route.name, route.base)
                raise upstream_failed(route.name, why)
            self._metrics.inc(self._metrics.retries, route.name)
            ep = min(
                others,
                key=lambda e: (load.failures(e.replica), load.load(e.replica), e.replica),
            )
            prefill = float(prompt_tokens)

    def _busy(self, ep: Endpoint) -> bool:
        """Whether ``ep`` failing reads as busy (alive and loaded); if so, its admission
        limit is halved here."""
        replica = ep.replica
        if not (
            self._load.alive(replica) and self._windows.loaded(replica, self._load.load(replica))
        ):
            return False
        limit = self._windows.busy(replica)
        self._metrics.inc(self._metrics.busy, replica)
        log.info("gateway_replica_busy", replica=replica, limit=limit)
        return True

    def computed(self, replica: str, prefill: float, claim: Claim | None) -> None:
        """The first token came: the prefill queues no one, its blocks are on their way."""
        self._load.prefilled(replica, prefill)
        if claim is not None:
            self._computing.record(*claim, replica, now=self._clock())

    def ended(
        self, replica: str, prefill: float, claim: Claim | None, *, computed: bool = True
    ) -> None:
        """The request ended (answered, failed or cancelled); what of it was not yet
        counted off at a first token is now. A request that failed (``computed`` False)
        leaves no claim: the replica most likely holds none of it."""
        self._load.finished(replica, prefill)
        if claim is None:
            return
        if computed:
            self._computing.record(*claim, replica, now=self._clock())
        else:
            self._computing.drop(*claim, replica)

    def failed(self, route: ModelRoute, ep: Endpoint, kind: str) -> None:
        """Count a failure of ``ep`` (``kind``: connect, timeout, disconnect, status,
        midstream) in the metrics and its passive health."""
        self._metrics.inc(self._metrics.upstream_errors, route.name, ep.replica, kind)
        if self._load.failed(ep.replica):
            self._metrics.inc(self._metrics.ejections, ep.replica)


async def _proxy_unreached(resp: aiohttp.ClientResponse) -> tuple[str | None, bytes | None]:
    """(why the answer says the request never reached an engine (``_PROXY_UNREACHED``), or
    None: it did; the body read to tell, None when none was read). The body read is the
    engine's answer when it reached one: the caller relays it, ``resp`` has none left."""
    code = _PROXY_UNREACHED.get(resp.status)
    if code is None:
        return None, None
    try:
        raw = await read_capped(resp, _PROXY_ERROR_MAX_BYTES)
    except (aiohttp.ClientError, TimeoutError):
        return None, b""
    if raw is None:  # past the proxy's sizes: the engine's, cut (an engine's 404 is small)
        return None, b""
    try:
        body = json.loads(raw or b"")
    except ValueError:
        return None, raw
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("code") == code:
        return f"the agent's proxy answered {resp.status} ({code})", raw
    return None, raw


def engine_said(status: int, raw: bytes) -> str | None:
    """What the engine itself answered, for a 5xx answer: its error message ("" when it wrote
    none that reads), or None when the answer is not the engine's verdict on the request but
    a failure on the way (the agent's proxy's codes, or a 502/503/504: an intermediary's or
    an overloaded server's status) that a retry may not meet.

    The proxy passes an engine's own answer through with the engine's status and body, and
    marks every failure of its own with a code (nodeagent.proxy); an engine that answered 500
    with a body ran the request and failed on it: vLLM and the simulator answer an exception
    in a request's handling so, and the same request fails the same way again."""
    body: object
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("code") in _PROXY_FAILED:
        return None
    if status in _INTERMEDIARY_STATUSES:
        return None
    message: object = None
    if isinstance(error, dict):
        message = error.get("message")
    elif isinstance(body, dict):
        message = body.get("message")  # vLLM's older shape: {"object": "error", "message": ...}
    elif body is None:
        # Not JSON: a framework's plain "Internal Server Error".
        message = raw[:_MESSAGE_MAX_BYTES].decode("utf-8", "replace").strip()
    return " ".join(message.split()) if isinstance(message, str) else ""
