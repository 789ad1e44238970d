"""Flow control: the gateway never sends a replica more than it admits, and holds the rest in
a bounded, fair queue per model, shedding (503 + Retry-After) what it cannot hold.

A request that reaches ``enter`` has passed its key's own limits (``limits``: 429). If no one
waits for its model and a replica of it has room (``admission``: the ceiling's AIMD limit
less this gateway's in flight less what other gateways put there, as last scraped), it goes
on at once, holding a *grant* until ``upstream.send`` counts it in flight. Otherwise it waits
in the model's ``FairQueue`` until ``dispatch`` hands it a grant (a request ended, a scrape
or the ticker found room), until ``gateway.queue_timeout_s`` (shed: 503), or until its
client leaves (the request's ``DisconnectWatch`` cancels it: it leaves the queue at once).
A request leaving the queue is routed by the normal rules at that moment, among the
replicas with room.

Scale from zero: a request for an autoscaled model (``ModelRoute.wakeable``) with no ready
replica is *held* in the same queue, under the same bounds (503 + Retry-After past them),
instead of an immediate 503. The first held request calls ``on_hold`` (the demand reporter
writes at once and NOTIFYs the leader), and the ticker re-reads the route table (``refresh``)
so held requests leave as soon as a replica is ready.

Memory: a held request keeps its parsed body alive, which costs up to ~24x its raw bytes
(``routing.held_cost``). A request about to be queued is charged what its body and prompt
really hold, walked in slices that give the loop back, against its model's
``gateway.queue_max_bytes`` and against ``gateway.queue_max_bytes_total`` for all models'
queues together (N models once allowed N times the per-model bound); past either it is refused
with 429 + Retry-After naming the bound, before it is queued. A request that goes on at once is
not walked: only what waits is held.

A wake that cannot succeed (the route's ``wake_blocked``: the leader cannot place a replica, or
the deployment's engine crash-loops, as ``store.routes`` reads it) answers the requests held
for it at once, and refuses new ones, with 503 + Retry-After and that reason, instead of
"overloaded" after the whole ``gateway.queue_timeout_s``.

The gateway's own upstream pool (``gateway.upstream_pool_size`` connections, all replicas)
bounds the sum as well, less a reserve for the load scrape and tokenizing: a request past
the pool would wait for a connection inside aiohttp, unfairly and against the connect
timeout (measured: 27 of a 6,000 burst answered 502 "timed out" with 768 admitted on a pool
of 512).

Grants count per model, not per replica: the router picks the replica after the grant, so a
grant is a claim on the model's summed room. A replica serving a model and its adapters is
counted under each name's grants; the overshoot that allows is bounded by the waiting
allowance every ceiling carries.

What it must NOT do: send anything to the client while a request waits (a stream sees no
header and no byte before its first token), order the queue (``fair_queue`` does), or hold a
grant past the request's send.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from llmgw.config import GatewaySettings
from llmgw.eventloop import cancel_and_wait
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.load import LoadTracker
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.gateway.routing.admission import AdmissionWindows
from llmgw.gateway.routing.fair_queue import DrainRate, FairQueue
from llmgw.gateway.routing.held_cost import walk
from llmgw.gateway.wire import Settleable
from llmgw.logs import get_logger

__all__ = ["Charged", "Demand", "FlowControl"]

log = get_logger("llmgw.gateway")

_TICK_S = 0.2
# Pool connections kept for the load scrape (one per replica) and tokenize calls: a pool
# full of requests would starve the scrape that tells busy from broken.
_POOL_RESERVE = 16
_RETRY_AFTER_FLOOR_S = 1.0
_RETRY_AFTER_CEILING_S = 60.0
# A wake the leader says cannot succeed needs an operator (a node, a fixed profile): retrying
# sooner than the leader's next passes finds the same reason.
_WAKE_BLOCKED_RETRY_S = 30.0
_MIB = 1024 * 1024
# Weight of each routed request in a model's moving hit rate (~the last 50).
_HIT_WEIGHT = 0.02


@dataclass(slots=True)
class Demand:
    """One model's demand on this gateway, as reported to Postgres (``store.demand``)."""

    model: str
    queued: int = 0
    in_flight: int = 0
    shed: int = 0  # requests shed since this process started
    saturated_since: float | None = None  # clock() when its queue last became non-empty
    # Queued requests of a model with no ready replica (all of its queue, then).
    held: int = 0
    # Prompt tokens (estimated) queued here plus those sent and not past prefill; and the
    # part of them no prefix cache holds (queued ones discounted by the model's hit rate).
    queued_prefill_tokens: int = 0
    uncached_prefill_tokens: int = 0
    # Share of routed prompt tokens a replica's cache held (moving average); None: none yet.
    hit_rate: float | None = None
    # What the model's engines reported waiting at the last scrape (their own queues).
    engine_waiting: int = 0


class FlowControl:
    def __init__(
        self,
        settings: GatewaySettings,
        *,
        load: LoadTracker,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._load = load
        self._metrics = metrics
        self._clock = clock
        self.windows = AdmissionWindows()
        self._queues: dict[str, FairQueue[asyncio.Future[None]]] = {}
        self._routes: dict[str, ModelRoute] = {}
        self._granted: dict[str, int] = {}
        self._drain: dict[str, DrainRate] = {}
        self.demand: dict[str, Demand] = {}
        self._queued_tokens: dict[str, int] = {}
        # model -> clock() of its first held request while no replica was ready.
        self._held_since: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        # Called when a model's first request is held (no ready replica): wakes the leader.
        self.on_hold: Callable[[], None] | None = None

    # --- the table and the ticker ---------------------------------------------------------

    def configure(self, table: RouteTable) -> None:
        """A new route table: replicas' ceilings, and the routes queues drain into."""
        ceilings: dict[str, int] = {}
        for route in table.routes.values():
            for ep in route.endpoints:
                ceilings[ep.replica] = ep.max_in_flight
        self.windows.configure(ceilings.items())
        # Queues of names gone from the table keep their last route: they drain or time out.
        self._routes.update(table.routes)
        for model, queue in self._queues.items():
            held_for = table.routes.get(model)
            if queue and held_for is not None and not held_for.endpoints and held_for.wake_blocked:
                self._answer_held(held_for, queue)
        now = self._clock()
        for model in [m for m in self._held_since if table.routes.get(m) is not None]:
            if table.routes[model].endpoints:
                woke = now - self._held_since.pop(model)
                self._metrics.observe(self._metrics.wake_seconds, woke, model)
                log.info("gateway_model_woken", model=model, waited_s=round(woke, 3))
        self.dispatch()

    async def start(self, refresh: Callable[[], object] | None = None) -> None:
        """``refresh``: re-read the route table (it calls ``configure`` when it changed), so
        held requests see a woken replica without a new request arriving."""

        async def tick() -> None:
            # Room also appears without a request of ours ending: a scrape shows other
            # gateways' requests gone, an AIMD limit grew back.
            while True:
                await asyncio.sleep(_TICK_S)
                if refresh is not None:
                    refresh()
                self.dispatch()
                self._report()
                for queue in self._queues.values():
                    queue.forget_idle()  # keys seen once do not stay in memory

        self._task = asyncio.create_task(tick(), name="gateway-flow")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for queue in self._queues.values():
            while (entry := queue.pop()) is not None:
                if not entry.item.done():
                    entry.item.cancel()

    # --- admission ------------------------------------------------------------------------

    def room(self, replica: str) -> int:
        load = self._load
        return self.windows.room(replica, load.in_flight.get(replica, 0), load.others(replica))

    def with_room(self, eps: list[Endpoint]) -> list[Endpoint]:
        """The candidates that can take a request now (all of them when none can: a request
        holding a grant is sent, and a race between two grants costs one over the limit)."""
        roomy = [ep for ep in eps if self.room(ep.replica) > 0]
        return roomy or eps

    def _model_room(self, route: ModelRoute) -> int:
        load = self._load
        eps = [ep for ep in route.endpoints if load.healthy(ep.replica)] or route.endpoints
        free = sum(max(0, self.room(ep.replica)) for ep in eps)
        pool = (
            max(1, self._settings.upstream_pool_size - _POOL_RESERVE)
            - sum(load.in_flight.values())
            - sum(self._granted.values())
        )
        return min(free - self._granted.get(route.name, 0), pool)

    async def enter(
        self,
        route: ModelRoute,
        key_id: str,
        priority: int,
        size_bytes: int,
        prompt_tokens: int = 0,
        held: tuple[object, ...] = (),
    ) -> None:
        """Return holding a grant for ``route``'s model (``release`` it when the request is
        sent or fails before), or raise the 503 that sheds it (the 429 of a memory bound).
        Cancelled (the client left, the process stops): leaves the queue at once.
        ``prompt_tokens``: its estimate, for the demand the autoscaler reads. ``held``: what
        the request keeps alive while it waits (its parsed body, its prompt text), walked for
        its cost only if it is queued; ``size_bytes`` (its raw body) is the least it costs."""
        model = route.name
        queue = self._queues.get(model)
        if route.endpoints and (queue is None or not queue) and self._model_room(route) > 0:
            self._granted[model] = self._granted.get(model, 0) + 1
            return
        if not route.endpoints and route.wake_blocked:
            raise self._wake_blocked(route)
        s = self._settings
        cost = await self._held_cost(model, size_bytes, held)
        if route.endpoints and self._model_room(route) > 0 and not self._queues.get(model):
            # Room appeared while the cost was walked.
            self._granted[model] = self._granted.get(model, 0) + 1
            return
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = FairQueue(
                max_requests=s.queue_max_requests, max_bytes=s.queue_max_bytes
            )
            self._drain[model] = DrainRate()
        now = self._clock()
        grant: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = queue.push(key_id, grant, size_bytes=cost, now=now, priority=priority)
        if isinstance(entry, str):
            if entry == "queue_bytes":
                raise self._memory_refusal(model, cost, "queue_bytes")
            raise self._shed(model, entry, len(queue))
        self._routes[model] = route
        demand = self.demand.setdefault(model, Demand(model))
        if demand.saturated_since is None:
            demand.saturated_since = now
        self._queued_tokens[model] = self._queued_tokens.get(model, 0) + prompt_tokens
        if not route.endpoints:
            if not demand.held and self.on_hold is not None:
                self.on_hold()
            self._held_since.setdefault(model, now)
            demand.held = len(queue)
        metrics = self._metrics
        metrics.add(metrics.queue_requests, 1, model, key_id)
        try:
            async with asyncio.timeout(s.queue_timeout_s):
                await grant
        except TimeoutError:
            queue.remove(entry)
            raise self._shed(model, "queue_timeout", len(queue)) from None
        except asyncio.CancelledError:
            # exception(): a wake-blocked answer set as it was cancelled is read, not logged.
            if grant.done() and not grant.cancelled() and grant.exception() is None:
                self.release(model)  # granted as it was cancelled: give the grant back
            else:
                queue.remove(entry)
            raise
        finally:
            left = self._queued_tokens.get(model, 0) - prompt_tokens
            self._queued_tokens[model] = max(0, left)
            metrics.add(metrics.queue_requests, -1, model, key_id)
            metrics.observe(metrics.queue_wait_seconds, self._clock() - now, model, key_id)

    async def _held_cost(self, model: str, size_bytes: int, held: tuple[object, ...]) -> int:
        """What the request would hold queued (its raw size at least), or the 429 of the
        memory bound it would break; walked only when the raw size alone breaks none."""
        s = self._settings
        queue = self._queues.get(model)
        if queue is not None and len(queue) >= s.queue_max_requests:
            raise self._shed(model, "queue_requests", len(queue))
        cost = size_bytes
        self._check_memory(model, cost)
        if held and s.queue_max_requests:
            steps = walk(held)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    cost = max(cost, int(done.value))
                    break
                await asyncio.sleep(0)  # a slice walked: let the loop serve others
            self._check_memory(model, cost)
        return cost

    def _check_memory(self, model: str, cost: int) -> None:
        queue = self._queues.get(model)
        if cost + (queue.num_bytes if queue is not None else 0) > self._settings.queue_max_bytes:
            raise self._memory_refusal(model, cost, "queue_bytes")
        if cost + self.held_bytes() > self._settings.queue_max_bytes_total:
            raise self._memory_refusal(model, cost, "queue_bytes_total")

    def held_bytes(self) -> int:
        """What every model's queue holds now, as charged."""
        return sum(queue.num_bytes for queue in self._queues.values())

    def release(self, model: str) -> None:
        """The grant's request was sent (counted in flight now) or failed before it was."""
        left = self._granted.get(model, 0) - 1
        if left > 0:
            self._granted[model] = left
        else:
            self._granted.pop(model, None)

    def routed(self, model: str, prompt_tokens: int, prefill: float) -> None:
        """A request was routed: ``prefill`` of its ``prompt_tokens`` are computed (the rest
        a replica's prefix cache holds); feeds the model's hit rate."""
        if prompt_tokens <= 0:
            return
        hit = max(0.0, min(1.0, 1.0 - prefill / prompt_tokens))
        demand = self.demand.setdefault(model, Demand(model))
        demand.hit_rate = (
            hit
            if demand.hit_rate is None
            else demand.hit_rate + _HIT_WEIGHT * (hit - demand.hit_rate)
        )

    def charge(self, model: str, key_id: str, tokens: int) -> None:
        """Tokens served to ``key_id`` on ``model``: what orders the queue's keys."""
        queue = self._queues.get(model)
        if queue is not None:
            queue.charge(key_id, tokens)

    def dispatch(self) -> None:
        """Hand grants to queued requests while their models have room."""
        now = self._clock()
        for model, queue in self._queues.items():
            if not queue:
                continue
            route = self._routes.get(model)
            if route is None:
                continue
            room = self._model_room(route)
            sent = 0
            while room > 0 and (entry := queue.pop()) is not None:
                if entry.item.done():  # cancelled as it was popped
                    continue
                entry.item.set_result(None)
                self._granted[model] = self._granted.get(model, 0) + 1
                room -= 1
                sent += 1
            if sent:
                self._drain[model].record(now, sent)
            if not queue:
                demand = self.demand.get(model)
                if demand is not None:
                    demand.saturated_since = None

    # --- shedding and reporting -----------------------------------------------------------

    def _retry_after(self, model: str, queued: int) -> float:
        drain = self._drain.get(model)
        if drain is None:
            return _RETRY_AFTER_FLOOR_S
        return drain.retry_after_s(
            queued, self._clock(), floor_s=_RETRY_AFTER_FLOOR_S, ceiling_s=_RETRY_AFTER_CEILING_S
        )

    def _shed(self, model: str, reason: str, queued: int) -> GatewayError:
        retry = self._retry_after(model, queued)
        self._metrics.inc(self._metrics.shed, model, reason)
        self.demand.setdefault(model, Demand(model)).shed += 1
        return GatewayError.overloaded(model, _SHED_WHY[reason], retry)

    def _memory_refusal(self, model: str, cost: int, bound: str) -> GatewayError:
        """429: the request's parsed body would take the queues past a memory bound. A 429,
        not a 503: the bodies' size is what clients send, and what they can change."""
        s = self._settings
        queued = len(self._queues.get(model) or ())
        self._metrics.inc(self._metrics.shed, model, bound)
        self.demand.setdefault(model, Demand(model)).shed += 1
        if bound == "queue_bytes":
            what = (
                f"{model!r}'s queue holds as much request memory as it may "
                f"(gateway.queue_max_bytes, {s.queue_max_bytes / _MIB:.0f} MiB)"
            )
        else:
            what = (
                "the gateway's queues hold as much request memory as they may, all models "
                f"together (gateway.queue_max_bytes_total, {s.queue_max_bytes_total / _MIB:.0f} MiB)"
            )
        log.info("gateway_held_memory_refused", model=model, bound=bound, cost_bytes=cost)
        return GatewayError.rate_limited(
            f"{what}, and this request would hold {cost / _MIB:.1f} MiB parsed while it waits "
            "for a replica; send smaller bodies or fewer at once",
            self._retry_after(model, queued),
        )

    def _wake_blocked(self, route: ModelRoute) -> GatewayError:
        """503: no replica of the model can start, for the reason the leader knows."""
        self._metrics.inc(self._metrics.shed, route.name, "wake_blocked")
        return GatewayError(
            503,
            f"no replica of {route.name!r} can start: {route.wake_blocked}; fix that cause "
            "(`llmgw status`, `llmgw get actions`), then retry after the time in Retry-After",
            type_="api_error",
            code="no_ready_replica",
            retry_after_s=_WAKE_BLOCKED_RETRY_S,
        )

    def _answer_held(self, route: ModelRoute, queue: FairQueue[asyncio.Future[None]]) -> None:
        """Every request held for ``route`` is answered with why its wake cannot succeed."""
        answered = 0
        while (entry := queue.pop()) is not None:
            if not entry.item.done():
                entry.item.set_exception(self._wake_blocked(route))
                answered += 1
        if answered:
            log.info(
                "gateway_held_answered", model=route.name, requests=answered,
                reason=route.wake_blocked,
            )  # fmt: skip

    def shed_busy(self, model: str) -> GatewayError:
        """A replica refused or reset while busy and no other could take the request."""
        return self._shed(model, "replica_busy", len(self._queues.get(model) or ()))

    def _report(self) -> None:
        metrics = self._metrics
        load = self._load
        for replica in self._replicas():
            metrics.gauge(metrics.admitted_in_flight, load.in_flight.get(replica, 0), replica)
            limit = self.windows.limit(replica)
            if limit is not None:
                metrics.gauge(metrics.admission_limit, limit, replica)
        for model, route in self._routes.items():
            demand = self.demand.setdefault(model, Demand(model))
            demand.queued = len(self._queues.get(model) or ())
            demand.in_flight = sum(load.in_flight.get(ep.replica, 0) for ep in route.endpoints)
            demand.held = 0 if route.endpoints else demand.queued
            if not route.endpoints and not demand.queued:
                self._held_since.pop(model, None)  # they gave up: the next wait starts anew
            metrics.gauge(metrics.held_requests, demand.held, model)
            demand.engine_waiting = sum(load.waiting.get(ep.replica, 0) for ep in route.endpoints)
            # What was sent and is not past prefill is exactly the uncached part (the router
            # counts a request's computed tokens); what waits here is discounted by hit rate.
            sent = int(sum(load.prefill.get(ep.replica, 0.0) for ep in route.endpoints))
            queued = self._queued_tokens.get(model, 0)
            demand.queued_prefill_tokens = queued + sent
            demand.uncached_prefill_tokens = sent + int(queued * (1.0 - (demand.hit_rate or 0.0)))

    def _replicas(self) -> Iterable[str]:
        seen: set[str] = set()
        for route in self._routes.values():
            seen.update(ep.replica for ep in route.endpoints)
        return seen

    def snapshot(self) -> list[Demand]:
        """Every model's demand now, for the periodic report to Postgres."""
        self._report()
        return [replace(d) for d in self.demand.values()]


_SHED_WHY = {
    "queue_requests": "its queue is full (gateway.queue_max_requests)",
    "queue_timeout": "no replica could take the request within gateway.queue_timeout_s",
    "replica_busy": "its replicas refused the connection while busy",
}


class Charged:
    """A key's admission (``limits``), also charging the completion tokens it settles to the
    model queue's fairness counter: a key is ordered by the tokens it was served (its prompt
    was charged when it was routed)."""

    __slots__ = ("_admission", "_flow", "_key_id", "_model")

    def __init__(self, admission: Settleable, flow: FlowControl, model: str, key_id: str):
        self._admission = admission
        self._flow = flow
        self._model = model
        self._key_id = key_id

    def settle(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self._flow.charge(self._model, self._key_id, completion_tokens)
        self._admission.settle(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        )

    def release(self) -> None:
        self._admission.release()
