"""llmgw.periodic: the one mechanism of periodic work (interval, one run at a time,
coalescing, backoff after failures, wake-ups, stop) and the one backoff formula.

Every wait is on a condition with a deadline; the timings asserted are bounds wide enough for
a loaded 2-core host, never exact."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import pytest

from llmgw.logs import configure_logging
from llmgw.periodic import Backoff, Periodic, backoff_delay
from tests.support.waiting import until


async def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    # A tight interval: the runs these tests count are tens of milliseconds apart.
    await until(cond, timeout_s=timeout_s, what="the condition", interval_s=0.005)


def test_backoff_delay_doubles_from_its_base_to_its_cap() -> None:
    assert [backoff_delay(n, 0.5, 5.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff_delay(10_000, 0.5, 5.0) == 5.0  # a long outage never overflows
    assert Backoff(1.0, 30.0).delay(3) == 8.0


async def test_runs_every_interval_the_first_one_interval_after_start() -> None:
    runs: list[float] = []

    async def job() -> None:
        runs.append(time.monotonic())

    p = Periodic(job, name="t-interval", interval_s=0.1)
    started = time.monotonic()
    p.start()
    try:
        await _until(lambda: len(runs) >= 4)
    finally:
        await p.stop()
    assert runs[0] - started >= 0.09
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    assert all(g >= 0.09 for g in gaps), gaps


async def test_run_at_start_runs_at_once() -> None:
    ran = asyncio.Event()

    async def job() -> None:
        ran.set()

    p = Periodic(job, name="t-first", interval_s=60.0, run_at_start=True)
    p.start()
    try:
        async with asyncio.timeout(5):
            await ran.wait()
    finally:
        await p.stop()


async def test_one_run_at_a_time_and_ticks_during_a_run_are_coalesced() -> None:
    running = 0
    most = 0
    runs = 0
    release = asyncio.Event()

    async def job() -> None:
        nonlocal running, most, runs
        running += 1
        most = max(most, running)
        runs += 1
        try:
            if runs == 1:
                await release.wait()  # a run ten intervals long
        finally:
            running -= 1

    p = Periodic(job, name="t-overlap", interval_s=0.02, run_at_start=True)
    p.start()
    try:
        await _until(lambda: runs == 1)
        await asyncio.sleep(0.2)  # ~10 ticks come and go while the first run lasts
        assert runs == 1
        release.set()
        await _until(lambda: runs >= 3)
    finally:
        await p.stop()
    assert most == 1


async def test_a_loop_blocked_past_several_ticks_runs_once_not_a_burst() -> None:
    runs: list[float] = []

    async def job() -> None:
        runs.append(time.monotonic())

    p = Periodic(job, name="t-coalesce", interval_s=0.1)
    p.start()
    try:
        # The whole loop blocked past six run times, and halfway to the seventh.
        time.sleep(0.65)  # noqa: ASYNC251 (the point of the test)
        await _until(lambda: len(runs) >= 1)
        for _ in range(20):  # a burst of the missed runs would come within these
            await asyncio.sleep(0)
        assert len(runs) == 1
        await _until(lambda: len(runs) >= 2)  # and the timetable goes on
    finally:
        await p.stop()


async def test_failures_back_off_and_a_success_resets_them() -> None:
    runs: list[float] = []
    errors: list[int] = []
    seen_failures: list[int] = []

    async def job() -> None:
        runs.append(time.monotonic())
        seen_failures.append(p.failures)
        if len(runs) <= 3:
            raise RuntimeError("database down")

    p = Periodic(
        job,
        name="t-backoff",
        interval_s=0.01,
        run_at_start=True,
        backoff=Backoff(base_s=0.05, max_s=0.15),
        on_error=lambda _exc, n: errors.append(n),
    )
    p.start()
    try:
        await _until(lambda: len(runs) >= 6)
    finally:
        await p.stop()
    assert errors == [1, 2, 3]
    # Waits after failures 1, 2, 3: 0.1, 0.15 (capped), 0.15, never the 0.01 interval.
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.14 and gaps[2] >= 0.14, gaps
    # The run that recovers still sees the old count; the one after, none.
    assert seen_failures[3] == 3 and seen_failures[4] == 0
    assert p.failures == 0


async def test_without_backoff_a_failure_waits_the_interval_and_is_logged(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", json=True)
    runs = 0

    async def job() -> None:
        nonlocal runs
        runs += 1
        raise ValueError("boom")

    p = Periodic(job, name="t-log", interval_s=0.02, run_at_start=True)
    p.start()
    try:
        await _until(lambda: runs >= 3)
    finally:
        await p.stop()
    err = capsys.readouterr().err
    assert err.count('"event": "periodic_job_failed"') >= 2, err
    assert "t-log" in err and "boom" in err


async def test_a_successful_run_logs_nothing_apscheduler_included(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", json=True)
    assert logging.getLogger("apscheduler.executors.default").getEffectiveLevel() >= logging.WARNING
    runs = 0

    async def job() -> None:
        nonlocal runs
        runs += 1

    p = Periodic(job, name="t-quiet", interval_s=0.02, run_at_start=True)
    p.start()
    try:
        await _until(lambda: runs >= 3)
    finally:
        await p.stop()
    assert capsys.readouterr().err == ""


async def test_wake_runs_now_and_after_a_run_in_progress() -> None:
    runs = 0
    gate = asyncio.Event()
    gate.set()

    async def job() -> None:
        nonlocal runs
        runs += 1
        await gate.wait()

    p = Periodic(job, name="t-wake", interval_s=60.0)
    p.start()
    try:
        p.wake()
        await _until(lambda: runs == 1)
        gate.clear()
        p.wake()
        await _until(lambda: runs == 2)  # this one holds on the gate
        p.wake()  # during the run: it follows once the run ends
        p.wake()  # twice: still one more run
        await asyncio.sleep(0.05)
        assert runs == 2
        gate.set()
        await _until(lambda: runs == 3)
        await asyncio.sleep(0.05)
        assert runs == 3
    finally:
        await p.stop()


async def test_wake_cuts_a_backoff_short() -> None:
    runs = 0

    async def job() -> None:
        nonlocal runs
        runs += 1
        raise RuntimeError("down")

    p = Periodic(
        job,
        name="t-wake-backoff",
        interval_s=0.01,
        run_at_start=True,
        backoff=Backoff(base_s=30.0, max_s=60.0),
        on_error=lambda _exc, _n: None,
    )
    p.start()
    try:
        await _until(lambda: runs == 1 and p.failures == 1)
        p.wake()
        await _until(lambda: runs == 2)
    finally:
        await p.stop()


async def test_stop_cancels_the_run_in_progress_and_nothing_runs_after() -> None:
    started = asyncio.Event()
    cancelled = False
    runs = 0

    async def job() -> None:
        nonlocal cancelled, runs
        runs += 1
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled = True
            raise

    p = Periodic(job, name="t-stop", interval_s=0.01, run_at_start=True)
    p.start()
    async with asyncio.timeout(5):
        await started.wait()
    async with asyncio.timeout(5):
        await p.stop()
    assert cancelled and not p.started
    p.wake()  # after stop: nothing
    await asyncio.sleep(0.1)
    assert runs == 1
    await p.stop()  # twice is fine


async def test_finish_ends_the_timetable_from_inside_the_job() -> None:
    runs = 0

    async def job() -> None:
        nonlocal runs
        runs += 1
        if runs == 2:
            p.finish()

    p = Periodic(job, name="t-finish", interval_s=0.02, run_at_start=True)
    p.start()
    try:
        await _until(lambda: runs == 2)
        await asyncio.sleep(0.15)
        assert runs == 2
    finally:
        await p.stop()


async def test_restarts_after_stop() -> None:
    runs = 0

    async def job() -> None:
        nonlocal runs
        runs += 1

    p = Periodic(job, name="t-restart", interval_s=0.02, run_at_start=True)
    p.start()
    await _until(lambda: runs >= 1)
    await p.stop()
    seen = runs
    p.start()
    try:
        await _until(lambda: runs > seen)
    finally:
        await p.stop()
