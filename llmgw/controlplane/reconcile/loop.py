"""The reconcile loop: the thin shell around ``compute_plan``.

Every control plane runs one; only the leader (``leader.py``) passes. A pass is::

    async with session.begin():
        await check_epoch(session, epoch)         # fenced: a stale leader writes nothing
        state = await load_snapshot(session, ...) # a constant number of queries
        adapters = await read_declared_adapters(session)       # one more
        demand = await read_demand(session, ...)  # one more, with autoscaling or adapters
        history.record(now, demand)
        snap, decisions = scale_snapshot(state.snapshot, history=history, ...)  # pure
        plan = compute_plan(snap, now)            # pure
        placement = adapter_pass(state.snapshot, demand, states=self._adapter_states)  # pure
        await apply_plan(session, plan, state, epoch=epoch)
        await apply_scale(session, decisions, state, epoch=epoch)
        await apply_adapters(session, placement, adapters, state, epoch=epoch)

Passes come every ``tick_s`` (the loop's own timed wait: the tick is one coroutine's sleep,
so it needs no scheduler and no thread) and early on a NOTIFY on the
channel admin writes signal and on the one a gateway holding a request for a model with no
ready replica signals (a subscription to the process's ``store.notify.NotifyHub``). A
notification is only a hint: lost or repeated ones do no harm, because each pass re-reads
everything (level-triggered). A gateway holding a request for a runtime adapter no replica
holds signals the same demand channel, and every pass places adapters whatever else it has
to do, so the held request's load is decided by the pass it wakes (its demand is "held").
A failing pass is retried on the next tick with a growing pause, never in a hot loop, and
logged with its traceback.

The adapter placement's hysteresis states (``plan_adapters``' windows) live in this process
only, between the passes of one lead: a new leader starts from what the replicas hold, as the
placement is built to, and a failed pass leaves the states of the last one that committed.

This module must NOT compute anything about the fleet; that is the plan's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.controlplane.reconcile.leader import FencedError, LeaderLock, check_epoch
from llmgw.controlplane.reconcile.read import LoadedState, load_snapshot
from llmgw.controlplane.reconcile.write import apply_adapters, apply_plan, apply_scale
from llmgw.logs import get_logger
from llmgw.periodic import backoff_delay
from llmgw.planner.adapter_pass import AdapterPass, DeclaredAdapter, adapter_demand, adapter_pass
from llmgw.planner.adapter_placement import (
    AdapterDemand,
    AdapterPlacementConfig,
    AdapterSpec,
    AdapterState,
)
from llmgw.planner.autoscale import Decision
from llmgw.planner.plan import compute_plan
from llmgw.planner.scaling import DemandHistory, ModelSignal, scale_snapshot
from llmgw.planner.snapshot import DeploymentId, PlanSettings
from llmgw.store.catalog import CHANGE_CHANNEL
from llmgw.store.demand import DEMAND_CHANNEL, ModelDemand, read_demand
from llmgw.store.notify import NotifyHub, Subscription
from llmgw.store.runtime_adapters import DeclaredAdapterRow, read_declared_adapters

__all__ = ["ReconcileMetrics", "Reconciler"]

log = get_logger("llmgw.controlplane.reconcile")

# After a failed pass: backoff_delay(failures, base, max) before the next try.
_BACKOFF_BASE_S = 0.5
_BACKOFF_MAX_S = 10.0
# A gateway's demand row older than this is of a gateway that stopped or cannot write (they
# write every 2 s): the autoscaler ignores it (admin.demand uses the same bound).
_DEMAND_FRESH_S = 10.0


@dataclass(frozen=True, slots=True)
class ReconcileMetrics:
    passes: Counter
    failures: Counter
    duration: Histogram
    actions: Counter
    leader: Gauge
    scale_decisions: Counter
    desired_replicas: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> ReconcileMetrics:
        return cls(
            passes=Counter(
                "llmgw_reconcile_passes_total", "Reconcile passes run.", registry=registry
            ),
            failures=Counter(
                "llmgw_reconcile_failures_total",
                "Reconcile passes that failed (retried with backoff).",
                registry=registry,
            ),
            duration=Histogram(
                "llmgw_reconcile_duration_seconds",
                "One pass: load, plan and apply.",
                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                registry=registry,
            ),
            actions=Counter(
                "llmgw_reconcile_actions_total",
                "Actions applied, by kind.",
                ["action"],
                registry=registry,
            ),
            leader=Gauge(
                "llmgw_reconcile_leader",
                "1 while this control plane leads the reconcile loop.",
                registry=registry,
            ),
            scale_decisions=Counter(
                "llmgw_autoscale_decisions_total",
                "Autoscaler decisions that changed a deployment's replica count, by direction.",
                ["deployment", "direction"],
                registry=registry,
            ),
            desired_replicas=Gauge(
                "llmgw_autoscale_desired_replicas",
                "Replicas the autoscaler wants serving (warm: placed, suspended included).",
                ["deployment", "kind"],
                registry=registry,
            ),
        )


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """A pass builds hundreds of thousands of short-lived, acyclic objects (rows, views,
    capacity maps); each allocation burst triggers full collections that walk every live
    object of the process, which made a pass grow faster than the fleet (measured 1.9x too
    fast from 1,000 to 5,000 nodes; linear with collection paused). Reference counting frees
    them all the same; the collector runs again right after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Reconciler:
    """Leader election, wake-ups and passes for one control plane process."""

    def __init__(
        self,
        *,
        sessions: async_sessionmaker[AsyncSession],
        libpq_url: str,
        instance_id: str,
        plan_settings: PlanSettings,
        tick_s: float = 2.0,
        metrics: ReconcileMetrics | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        notify: NotifyHub | None = None,
        adapter_config: AdapterPlacementConfig | None = None,
    ) -> None:
        """``notify``: the process's hub; None (a test, a bench): one of its own on
        ``libpq_url``, run while ``run`` runs. ``adapter_config``: the adapter placement's
        targets and windows; None: its defaults."""
        self._sessions = sessions
        self._settings = plan_settings
        self._tick_s = tick_s
        self._metrics = metrics or ReconcileMetrics.create(CollectorRegistry())
        self._clock = clock
        self._lock = LeaderLock(libpq_url, instance_id=instance_id)
        self._wake = asyncio.Event()
        self._own_notify = notify is None
        self._notify = notify or NotifyHub(
            libpq_url, application_name=f"llmgw-listen-{instance_id}"
        )
        # A NOTIFY only brings the next pass forward; nothing is re-read on a reconnect, since
        # every pass reads everything and the tick runs one soon anyway.
        self._subscription = Subscription([CHANGE_CHANNEL, DEMAND_CHANNEL], self._wake.set)
        self._failures = 0
        # When this process began watching the fleet without a gap: set on taking the lead,
        # cleared by a failed pass. Nodes are judged silent only from then (load_snapshot).
        self._observing_since: datetime | None = None
        self.passes_applied = 0
        # Only the leader's passes record; emptied when the lead is lost (a gap it cannot see).
        self._history = DemandHistory()
        self._adapter_config = adapter_config or AdapterPlacementConfig()
        # plan_adapters' states after the last committed pass; emptied with the history.
        self._adapter_states: dict[str, AdapterState] = {}

    @property
    def epoch(self) -> int | None:
        return self._lock.epoch

    def wake(self) -> None:
        """Ask for a pass soon (an admin write in this process, a test)."""
        self._wake.set()

    @property
    def plan_settings(self) -> PlanSettings:
        return self._settings

    @property
    def tick_s(self) -> float:
        return self._tick_s

    def reconfigure(self, *, plan_settings: PlanSettings, tick_s: float) -> None:
        """New rules and period from a config reload (SIGHUP); the next pass uses them.

        Only between passes: ``pass_once`` reads the settings once, at its start, so a pass
        never mixes two grace periods.
        """
        self._settings = plan_settings
        # The wait after the pass this wakes is the first one of the new length.
        self._tick_s = tick_s
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set: lead when possible and pass on every tick or wake-up."""
        self._notify.add(self._subscription)
        if self._own_notify:
            await self._notify.start()
        try:
            while not stop.is_set():
                await self._step()
                pause = self._pause_s()
                # After a failure only a stop cuts the backoff short: ticks and notifications
                # would otherwise retry a failing database every tick.
                waits = {asyncio.ensure_future(stop.wait())}
                if not self._failures:
                    waits.add(asyncio.ensure_future(self._wake.wait()))
                try:
                    await asyncio.wait(waits, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
                # Always: a wake-up left set would make every later wait return at once, and
                # a leader whose database is gone would retry its lock in a hot loop.
                self._wake.clear()
        finally:
            self._notify.remove(self._subscription)
            if self._own_notify:
                await self._notify.stop()
            await self._lock.release()
            self._metrics.leader.set(0)

    def _pause_s(self) -> float:
        if self._failures:
            return backoff_delay(self._failures, _BACKOFF_BASE_S, _BACKOFF_MAX_S)
        return self._tick_s

    async def _step(self) -> None:
        epoch = self._lock.epoch
        if epoch is None or not await self._lock.still_held():
            self._observing_since = None
            self._history.clear()
            self._adapter_states = {}
            epoch = await self._lock.try_acquire()
        self._metrics.leader.set(1 if epoch is not None else 0)
        if epoch is None:
            return
        try:
            await self.pass_once(epoch)
            self._failures = 0
        except FencedError as exc:
            log.warning("reconcile_fenced", epoch=epoch, error=exc.message)
            await self._lock.release()
        except Exception:
            # Transient (Postgres restarting, a serialization failure): retried with backoff.
            self._failures += 1
            self._observing_since = None
            self._metrics.failures.inc()
            log.exception("reconcile_failed", epoch=epoch, failures=self._failures)

    async def pass_once(self, epoch: int) -> dict[str, int]:
        """One fenced pass; returns the actions applied by kind."""
        start = time.perf_counter()
        now = self._clock()
        settings = self._settings
        if self._observing_since is None:
            self._observing_since = now
        async with self._sessions() as session, session.begin():
            await check_epoch(session, epoch)
            with _cyclic_gc_paused():
                state = await load_snapshot(
                    session, settings=settings, now=now, observing_since=self._observing_since
                )
                snap = state.snapshot
                declared = await read_declared_adapters(session)
                demand = (
                    await read_demand(session, fresh_s=_DEMAND_FRESH_S)
                    if state.scale or declared
                    else []
                )
                decisions: dict[DeploymentId, Decision] = {}
                if state.scale:
                    self._history.record(now, set(state.served.values()), _signals(demand))
                    snap, decisions = scale_snapshot(
                        state.snapshot,
                        history=self._history,
                        served=state.served,
                        state=state.scale,
                        broken=state.broken,
                        now=now,
                    )
                plan = compute_plan(snap, now)
                placement = self._place_adapters(state, declared, demand, now)
            if plan:
                await apply_plan(session, plan, state, epoch=epoch)
            if decisions:
                await apply_scale(session, decisions, state, epoch=epoch)
            if placement is not None:
                await apply_adapters(session, placement, declared, state, epoch=epoch)
        if placement is not None:
            # Committed: what the next pass's windows start from.
            self._adapter_states = dict(placement.states)
        names = {d.id: d.name for d in snap.deployments}
        for dep_id, dec in decisions.items():
            name = names.get(dep_id, "")
            self._metrics.desired_replicas.labels(name, "serving").set(dec.desired)
            self._metrics.desired_replicas.labels(name, "warm").set(dec.warm)
            if dec.changed:
                before = state.scale[dep_id].desired
                direction = (
                    "up" if dec.desired > before else "down" if dec.desired < before else "warm"
                )
                self._metrics.scale_decisions.labels(name, direction).inc()
                log.info("autoscaled", deployment=name, desired=dec.desired, warm=dec.warm,
                         reason=dec.reason)  # fmt: skip
        counts = plan.counts()
        if placement is not None and placement.changes:
            adapter_counts = placement.counts()
            counts = {**counts, **adapter_counts}
            log.info("adapters_placed", epoch=epoch, **adapter_counts)
        self._metrics.passes.inc()
        self._metrics.duration.observe(time.perf_counter() - start)
        for kind, n in counts.items():
            self._metrics.actions.labels(kind).inc(n)
        if plan:
            self.passes_applied += 1
            log.info("reconciled", epoch=epoch, **counts)
        for deployment, why in state.broken.items():
            log.warning("profile_unlaunchable", deployment=deployment, reason=why)
        return counts

    def _place_adapters(
        self,
        state: LoadedState,
        declared: list[DeclaredAdapterRow],
        demand: list[ModelDemand],
        now: datetime,
    ) -> AdapterPass | None:
        """This pass's adapter placement; None when no adapter is declared and no shard is told
        to hold one (nothing to place or undo)."""
        if not declared and not any(h.desired for h in state.adapter_holders.values()):
            return None
        names = [a.name for a in declared]
        return adapter_pass(
            state.snapshot,
            adapters=[
                DeclaredAdapter(
                    AdapterSpec(a.name, a.model, a.min_replicas, a.max_replicas, a.pinned), a.path
                )
                for a in declared
            ],
            holders=state.adapter_holders,
            served=state.adapter_served,
            demand=adapter_demand(
                names,
                _adapter_signals(demand, set(names)),
                # Only "none" or "some" matters: an unreported adapter is idle when some
                # gateway reports at all, unknown when none does.
                fresh_gateways=max((r.gateways for r in demand), default=0),
            ),
            states=self._adapter_states,
            now=now.timestamp(),
            config=self._adapter_config,
        )


def _signals(rows: list[ModelDemand]) -> dict[str, ModelSignal]:
    """The gateways' summed rows as the autoscaler's signals: waiting is what the gateways
    queue (held included) plus what the engines report waiting."""
    return {
        r.model: ModelSignal(
            gateways=r.gateways,
            waiting_requests=r.queued + r.engine_waiting,
            queued_prefill_tokens=r.queued_prefill_tokens,
            uncached_prefill_tokens=r.uncached_prefill_tokens,
            in_flight=r.in_flight,
            held=r.held,
        )
        for r in rows
    }


def _adapter_signals(rows: list[ModelDemand], names: set[str]) -> dict[str, AdapterDemand]:
    """The gateways' rows under the adapters' names as the placement's demand (an adapter's
    own row: its base model's counts its requests too, and is not added in). Waiting is what
    the gateways queue (held included) plus what the engines report waiting."""
    return {
        r.model: AdapterDemand(
            gateways=r.gateways,
            requests_per_s=r.requests_per_s,
            in_flight=r.in_flight,
            waiting=r.queued + r.engine_waiting,
        )
        for r in rows
        if r.model in names
    }
