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

Runtime adapters (issue [lora]): a request for a declared adapter no ready replica has loaded
(``ModelRoute.runtime`` with no endpoints) is held the same way while the leader places it and
an agent loads it: ``on_hold`` wakes the leader, and the route NOTIFY that an agent's report of
the load fires re-reads the table, so it leaves the queue for the replica that loaded it. Past
``gateway.queue_timeout_s`` it is answered 503 ``adapter_loading`` naming the adapter; when its
load failed on every replica the leader chose (``ModelRoute.adapter_blocked``) at once, with the
engine's reason. Demand: each name's row counts its own requests, and a base model's row also
its adapters' (queued, and held while the base itself has no ready replica; in flight and the
engines' queues are per replica, so they were the base's already): the base's autoscaler sees
all the load its replicas will run. Each name's recent request rate (``requests_per_s``, about
a minute's moving average) is what the leader sizes an adapter's holders by.

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
# An adapter still loading when its held request's wait ran out: a load takes seconds.
_ADAPTER_LOADING_RETRY_S = 5.0
# Requests received per name: counted in windows of this long, each blended into a moving
# average with this weight, so a window's count fades over about a minute.
_RATE_WINDOW_S = 5.0
_RATE_WEIGHT = _RATE_WINDOW_S / 60.0
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
    # Requests received for the name per second, a moving average over about a minute.
    requests_per_s: float = 0.0


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
        # name -> requests sent and not ended: an adapter's own in flight (a replica's count
        # holds its base model's requests and every adapter's together).
        self._sending: dict[str, int] = {}
        # name -> requests received (``received``); names come from the route table.
        self._rates: dict[str, DrainRate] = {}
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
            if queue and held_for is not None and _blocked(held_for):
                self._answer_held(held_for, queue)
        now = self._clock()
        for model in [m for m in self._held_since if table.routes.get(m) is not None]:
            route = table.routes[model]
            if not route.endpoints:
                continue
            waited = round(now - self._held_since.pop(model), 3)
            if route.runtime:  # no wake: a load on a replica already serving
                log.info("gateway_adapter_loaded", adapter=model, waited_s=waited)
                continue
            self._metrics.observe(self._metrics.wake_seconds, waited, model)
            log.info("gateway_model_woken", model=model, waited_s=waited)
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
        self.received(route)
        queue = self._queues.get(model)
        if route.endpoints and (queue is None or not queue) and self._model_room(route) > 0:
            self._granted[model] = self._granted.get(model, 0) + 1
            return
        if _blocked(route):
            raise self._blocked_error(route)
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
        # Held for a runtime adapter loaded nowhere: how its wait ends is counted.
        loading = route.runtime and not route.endpoints
        outcome = "gone"
        try:
            async with asyncio.timeout(s.queue_timeout_s):
                await grant
            outcome = "loaded"
        except TimeoutError:
            outcome = "timeout"
            queue.remove(entry)
            now_route = self._routes.get(model, route)
            if now_route.runtime and not now_route.endpoints:
                raise self._adapter_loading(now_route) from None
            raise self._shed(model, "queue_timeout", len(queue)) from None
        except GatewayError:
            outcome = "failed"  # answered with why it cannot load (``_answer_held``)
            raise
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
            if loading:
                metrics.inc(metrics.adapter_held_answered, model, outcome)

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

    def received(self, route: ModelRoute) -> None:
        """A request for ``route`` reached admission: counted in its name's request rate, and
        an adapter's in its base model's too (the base's replicas serve it)."""
        now = self._clock()
        for name in (route.name, route.base) if route.base != route.name else (route.name,):
            rate = self._rates.get(name)
            if rate is None:
                rate = self._rates[name] = DrainRate(window_s=_RATE_WINDOW_S, weight=_RATE_WEIGHT)
            rate.record(now)

    def sending(self, model: str) -> None:
        """A request for ``model`` is being sent (its grant handed over): in flight under its
        own name until ``done``."""
        self._sending[model] = self._sending.get(model, 0) + 1

    def done(self, model: str) -> None:
        """A request ``sending`` counted ended, however it ended."""
        left = self._sending.get(model, 0) - 1
        if left > 0:
            self._sending[model] = left
        else:
            self._sending.pop(model, None)

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

    def _adapter_loading(self, route: ModelRoute) -> GatewayError:
        """503: a request held for a runtime adapter waited ``gateway.queue_timeout_s`` and no
        ready replica has loaded it yet."""
        self._metrics.inc(self._metrics.shed, route.name, "adapter_loading")
        self.demand.setdefault(route.name, Demand(route.name)).shed += 1
        base = self._routes.get(route.base)
        if base is not None and not base.endpoints:
            what = f"waits for a replica of model {route.base!r} to start and load it"
        else:
            what = f"is being loaded on a replica of model {route.base!r}"
        return GatewayError(
            503,
            f"adapter {route.name!r} {what}; retry after the time in Retry-After "
            f"(`llmgw get adapters {route.name}` shows where it is placed)",
            type_="api_error",
            code="adapter_loading",
            retry_after_s=_ADAPTER_LOADING_RETRY_S,
        )

    def _blocked_error(self, route: ModelRoute) -> GatewayError:
        """503: nothing will serve ``route`` while a request waits (``_blocked``): its wake
        cannot succeed, or its runtime adapter will not load."""
        blocked = route.adapter_blocked
        if route.wake_blocked or blocked is None:
            return self._wake_blocked(route)
        self._metrics.inc(self._metrics.shed, route.name, blocked.code)
        return GatewayError(
            503,
            blocked.message,
            type_="api_error",
            code=blocked.code,
            retry_after_s=_WAKE_BLOCKED_RETRY_S,
        )

    def _answer_held(self, route: ModelRoute, queue: FairQueue[asyncio.Future[None]]) -> None:
        """Every request held for ``route`` is answered with why nothing will serve it."""
        answered = 0
        while (entry := queue.pop()) is not None:
            if not entry.item.done():
                entry.item.set_exception(self._blocked_error(route))
                answered += 1
        if answered:
            blocked = route.adapter_blocked
            log.info(
                "gateway_held_answered", model=route.name, requests=answered,
                reason=route.wake_blocked or (blocked.message if blocked else ""),
            )  # fmt: skip

    def shed_busy(self, model: str) -> GatewayError:
        """A replica refused or reset while busy and no other could take the request."""
        return self._shed(model, "replica_busy", len(self._queues.get(model) or ()))

    def _report(self) -> None:
        metrics = self._metrics
        load = self._load
        now = self._clock()
        for replica in self._replicas():
            metrics.gauge(metrics.admitted_in_flight, load.in_flight.get(replica, 0), replica)
            limit = self.windows.limit(replica)
            if limit is not None:
                metrics.gauge(metrics.admission_limit, limit, replica)
        adapters: dict[str, list[str]] = {}  # base model -> its adapters' names
        for model, route in self._routes.items():
            if route.lora is not None and route.base != model and route.base in self._routes:
                adapters.setdefault(route.base, []).append(model)
        for model, route in self._routes.items():
            demand = self.demand.setdefault(model, Demand(model))
            queued = len(self._queues.get(model) or ())
            tokens = self._queued_tokens.get(model, 0)
            if not route.endpoints and not queued:
                self._held_since.pop(model, None)  # they gave up: the next wait starts anew
            rate = self._rates.get(model)
            demand.requests_per_s = rate.rate(now) if rate is not None else 0.0
            hit = demand.hit_rate or 0.0
            if route.lora is not None:
                # An adapter's own requests only: what its replicas run and queue is counted
                # per replica, under its base model (below).
                demand.queued = queued
                demand.in_flight = self._sending.get(model, 0)
                demand.held = 0 if route.endpoints else queued
                demand.engine_waiting = 0
                demand.queued_prefill_tokens = tokens
                demand.uncached_prefill_tokens = int(tokens * (1.0 - hit))
                held = metrics.adapter_held_requests if route.runtime else metrics.held_requests
                metrics.gauge(held, demand.held, model)
                continue
            # A model's row with its adapters' queues: its replicas will run them, and its
            # autoscaler must see them (a request held for an adapter of a model at zero
            # replicas wakes the model).
            for adapter in adapters.get(model, ()):
                queued += len(self._queues.get(adapter) or ())
                tokens += self._queued_tokens.get(adapter, 0)
            demand.queued = queued
            demand.in_flight = sum(load.in_flight.get(ep.replica, 0) for ep in route.endpoints)
            demand.held = 0 if route.endpoints else queued
            metrics.gauge(metrics.held_requests, demand.held, model)
            demand.engine_waiting = sum(load.waiting.get(ep.replica, 0) for ep in route.endpoints)
            # What was sent and is not past prefill is exactly the uncached part (the router
            # counts a request's computed tokens); what waits here is discounted by hit rate.
            sent = int(sum(load.prefill.get(ep.replica, 0.0) for ep in route.endpoints))
            demand.queued_prefill_tokens = tokens + sent
            demand.uncached_prefill_tokens = sent + int(tokens * (1.0 - hit))

    def _replicas(self) -> Iterable[str]:
        seen: set[str] = set()
        for route in self._routes.values():
            seen.update(ep.replica for ep in route.endpoints)
        return seen

    def snapshot(self) -> list[Demand]:
        """Every model's demand now, for the periodic report to Postgres."""
        self._report()
        return [replace(d) for d in self.demand.values()]


def _blocked(route: ModelRoute) -> bool:
    """Whether nothing will serve ``route`` while a request waits: no ready replica, and its
    wake cannot succeed or its runtime adapter will not load."""
    return not route.endpoints and bool(route.wake_blocked or route.adapter_blocked)


_SHED_WHY = {
    "queue_requests": "its queue is full (gateway.queue_max_requests)",
    "queue_timeout": "no replica could take the request within gateway.queue_timeout_s",
    "replica_busy": "its replicas refused the connection while busy",
}


class Charged:
    """A key's admission (``limits``), also charging the completion tokens it settles to the
    model queue's fairness counter: a key is ordered by the tokens it was served (its prompt
    was charged when it was routed)."""

    __slots__ = ("_admission", "_flow", "_key_id", "_model", "reserved_output")

    def __init__(
        self,
        admission: Settleable,
        flow: FlowControl,
        model: str,
        key_id: str,
        *,
        reserved_output: int = 0,
    ):
        self._admission = admission
        self._flow = flow
        self._model = model
        self._key_id = key_id
        # The output tokens reserved for it: what an answer without usage is charged where
        # the engine goes on generating after it (a background response).
        self.reserved_output = reserved_output

    def settle(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self._flow.charge(self._model, self._key_id, completion_tokens)
        self._admission.settle(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
        )

    def release(self) -> None:
        self._admission.release()
