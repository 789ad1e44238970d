"""Periodic work on one mechanism: ``Periodic`` runs a coroutine every ``interval_s`` on
APScheduler's asyncio scheduler, one run at a time, until stopped; ``backoff_delay`` is the one
spelling of "wait longer after each failure".

What APScheduler gives: the timetable (an interval trigger, optional jitter so processes that
started together do not query together), coalescing (a loop that was blocked past several
run times runs once, never a burst) and no misfire cut-off (a late run still runs). What this
module adds around it, because the scheduler cannot do it for a job that awaits:

- one run at a time with no warning: the scheduler's job only *starts* the run as a task of
  our own and returns at once, so its ``max_instances`` never refuses (it would log a
  warning every tick while a database call hangs). A tick that comes while a run is still
  going is dropped: the next one after it runs;
- failures: a run that raises is counted and reported (``on_error``); with a ``Backoff`` the
  next run waits ``backoff_delay(failures, ...)``, never the interval, so a database that is
  down is not retried at the rate of a healthy one. APScheduler would only log the traceback;
- ``wake()``: run as soon as possible (after the run in progress, if one is);
- ``stop()``: no further run starts, the run in progress is cancelled and awaited (the
  scheduler's own shutdown cancels its tasks without waiting, and logs a cancelled coroutine
  job as a failure).

The scheduler's clock is the wall clock; its own log lines are kept at warning level by
``llmgw.logs`` so a run that succeeds logs nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from apscheduler.job import Job
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from llmgw.eventloop import cancel_and_wait
from llmgw.logs import get_logger

__all__ = ["Backoff", "Periodic", "backoff_delay"]

log = get_logger("llmgw.periodic")


def backoff_delay(failures: int, base_s: float, max_s: float) -> float:
    """The pause after ``failures`` consecutive failures: ``base_s * 2**failures``, at most
    ``max_s`` (the exponent is bounded first, so a long outage never overflows a float)."""
    return float(min(max_s, base_s * 2 ** min(max(failures, 0), 64)))


@dataclass(frozen=True, slots=True)
class Backoff:
    """After a failed run, wait ``backoff_delay(failures, base_s, max_s)`` for the next."""

    base_s: float
    max_s: float

    def delay(self, failures: int) -> float:
        return backoff_delay(failures, self.base_s, self.max_s)


class Periodic:
    """Run ``job`` every ``interval_s`` (plus up to ``jitter_s``), one run at a time.

    The first run comes one interval after ``start()``, or at once with ``run_at_start``;
    the interval is counted from one run's start to the next (a run that outlasts it makes
    the ticks it covered drop, and the next tick after it runs).
    A run that raises an ``Exception`` is counted in ``failures`` (consecutive, reset by the
    next run that returns) and passed to ``on_error(exc, failures)`` (by default logged as a
    warning, each time); the next run then waits ``backoff.delay(failures)`` when a
    ``backoff`` is given, else the interval. ``failures`` is still the old count while a run
    goes on, so a job can log that it recovered.
    """

    def __init__(
        self,
        job: Callable[[], Awaitable[object]],
        *,
        name: str,
        interval_s: float,
        run_at_start: bool = False,
        jitter_s: float = 0.0,
        backoff: Backoff | None = None,
        on_error: Callable[[Exception, int], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self.failures = 0
        self._job = job
        self._run_at_start = run_at_start
        self._jitter_s = jitter_s
        self._backoff = backoff
        self._on_error = on_error or self._log_error
        self._scheduler: AsyncIOScheduler | None = None
        self._tick: Job | None = None
        self._run: asyncio.Task[None] | None = None
        # A wake-up asked for while a run goes on (or before start): honoured when it ends.
        self._woken = False
        # A run already asked of the scheduler for now: a burst of wake-ups (one per record
        # past a threshold) asks once.
        self._due_now = False
        self._finished = False

    @property
    def started(self) -> bool:
        return self._scheduler is not None

    def start(self) -> None:
        """Start the timetable; call on the running loop. Starting twice is a no-op."""
        if self._scheduler is not None:
            return
        self._finished = False
        scheduler = AsyncIOScheduler(timezone=UTC)
        now = datetime.now(UTC)
        first = (
            now if self._run_at_start or self._woken else now + timedelta(seconds=self.interval_s)
        )
        self._woken = False
        self._tick = scheduler.add_job(
            self._fire,
            IntervalTrigger(seconds=self.interval_s, jitter=self._jitter_s or None, timezone=UTC),
            id=self.name,
            name=self.name,
            next_run_time=first,
            coalesce=True,
            # Our job returns at once: one instance is all it ever needs, and a run fired
            # late (a busy loop) must still run, not be dropped as missed.
            max_instances=1,
            misfire_grace_time=None,
        )
        scheduler.start()
        self._scheduler = scheduler

    def wake(self) -> None:
        """Run as soon as possible: now, or right after the run in progress. It cuts a
        backoff short too (the caller knows of work that will not wait)."""
        if self._finished:
            return
        if self._run is not None and not self._run.done():
            self._woken = True
        elif self._scheduler is None:
            self._woken = True  # start() runs it at once
        elif not self._due_now:
            self._due_now = True
            self._next_run_in(0.0)

    def finish(self) -> None:
        """Run no more (a job calls it once its work is done for good); ``stop()`` still
        releases the scheduler."""
        self._finished = True
        if self._tick is not None and self._scheduler is not None:
            self._tick.pause()

    async def stop(self) -> None:
        """No run starts after this; the one in progress is cancelled and waited for."""
        scheduler, self._scheduler = self._scheduler, None
        self._tick = None
        self._woken = self._due_now = False
        if scheduler is not None:
            # Only queued on the loop (AsyncIOScheduler defers it): the yield lets it run, so
            # a stopped Periodic holds no timer. A tick already queued finds no scheduler.
            scheduler.shutdown(wait=False)
            await asyncio.sleep(0)
        run, self._run = self._run, None
        await cancel_and_wait(run)

    # --- internals ----------------------------------------------------------

    async def _fire(self) -> None:
        """The scheduler's job: start a run unless one is going (then this tick is dropped)."""
        self._due_now = False
        if self._scheduler is None or self._finished:
            return
        if self._run is not None and not self._run.done():
            return
        self._run = asyncio.create_task(self._run_once(), name=self.name)

    async def _run_once(self) -> None:
        try:
            await self._job()
        except Exception as exc:
            self.failures += 1
            try:
                self._on_error(exc, self.failures)
            except Exception:  # a broken error report must not stop the timetable
                log.exception("periodic_on_error_failed", job=self.name)
            if self._backoff is not None and not self._woken:
                self._next_run_in(self._backoff.delay(self.failures))
        else:
            self.failures = 0
        if self._woken:
            self._woken = False
            self._next_run_in(0.0)

    def _next_run_in(self, delay_s: float) -> None:
        if self._tick is None or self._scheduler is None or self._finished:
            return
        self._tick.modify(next_run_time=datetime.now(UTC) + timedelta(seconds=delay_s))

    def _log_error(self, exc: Exception, failures: int) -> None:
        log.warning("periodic_job_failed", job=self.name, failures=failures, error=repr(exc))
