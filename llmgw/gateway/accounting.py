"""Usage accounting: tokens and requests per key, model and minute, written in batches.

``UsageRecorder.record`` only adds to a dict in memory; a background task writes what was
recorded to ``usage_buckets`` every ``flush_interval_s`` (or sooner, once ``flush_records``
records are waiting), one transaction per flush, so the request path never waits on
Postgres and Postgres sees one statement per second per gateway, not one per request.

Idempotent flushes. Each flush has a sequence number, and its transaction
(``store.usage.apply_flush``) inserts ``usage_flushes (process_id, flush_seq)`` before adding
to the buckets. A flush whose commit reply was lost (the connection dropped after COMMIT) is
retried with the same number and the same rows, finds its row and adds nothing: counted once.
While a flush's outcome is unknown, new records go to the next batch, never into it. A process
keeps only its latest ``usage_flushes`` row (it never retries an older number), so that table
stays one row per process.

Postgres down. Records keep accumulating in memory and the flush is retried with a growing
pause (at most ``_BACKOFF_MAX_S``). Memory is bounded: at most ``max_pending_buckets``
distinct (key, model, minute) buckets wait in memory (100,000 by default, about 30 MB), plus
the one batch being retried (as large at most). Beyond the bound, a record whose minute has
no bucket yet is added to the newest waiting bucket of the same key and model: its totals
stay exact and only its minute is wrong. A record for a key and model with no waiting
bucket at all is dropped, counted in ``num_dropped`` and logged (``usage_dropped``): with the
default bound that takes an outage of over an hour with thousands of busy (key, model) pairs.

Quotas (read by ``limits.Limiter``). ``period_tokens`` is the prompt + completion tokens of
a key in its current UTC day or month: the totals Postgres had at the last read (every
``quota_refresh_s``, and at start), plus what this process flushed since, plus what it has
not flushed yet. Reads and flushes of this process are serialised, so its own usage is never
counted twice or missed. Until the first read succeeds (Postgres down when the gateway
starts), a quota counts only this process's usage: it fails open, as the keys fail static.

How far N gateways can overshoot a quota. A gateway sees another's usage only after that one
flushed it (up to ``flush_interval_s``, 1 s) and it read the totals again (up to
``quota_refresh_s``, 5 s): a window of about 6 s. Each gateway alone never admits past the
quota by its own count (it reserves ``max_tokens`` up front), so with R tokens left when
the window opens the key can use at most N x R before every gateway sees it: an overshoot of
at most (N - 1) x R, in practice (N - 1) x what one gateway serves the key in ~6 s (its tpm
limit bounds that). Even with N = 1 a request may use more than it reserved (when the
caller's estimate of the prompt was low): that difference is billed, not refused.

The most a crash can lose. What was recorded and not yet committed: normally up to
``flush_interval_s`` of usage (about a second); during a Postgres outage, everything
recorded since it began, up to the memory bound above. The usage of requests still running
is recorded only when they settle, so a crash also loses theirs. ``stop()`` flushes what is
left (retrying for up to ``stop_timeout_s``) and logs ``usage_flush_lost`` with the totals
it could not write.

What this module must NOT do: block the request path (``record`` never awaits), or lose a
flush silently.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from calendar import monthrange
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.logs import get_logger
from llmgw.periodic import Backoff, Periodic, backoff_delay
from llmgw.store.usage import UsageRow, apply_flush, quota_totals

__all__ = ["QuotaPeriod", "UsageRecorder", "new_process_id", "period_bounds"]

log = get_logger("llmgw.gateway.accounting")

QuotaPeriod = Literal["day", "month"]
_PERIODS: tuple[QuotaPeriod, ...] = ("day", "month")
_BACKOFF_BASE_S = 0.5
_BACKOFF_MAX_S = 5.0
# How often "usage_dropped" may be logged: a long outage must not flood the log.
_DROP_LOG_EVERY_S = 10.0
# api_keys.last_used_at is an UPDATE of the key's row: at most once a minute per key.
_TOUCH_EVERY_S = 60.0


def new_process_id() -> str:
    """Unique per process start: a restarted gateway must never reuse an old sequence."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def period_bounds(now_s: float, period: str) -> tuple[float, float]:
    """[start, end) in epoch seconds of the UTC day or month holding ``now_s``."""
    t = datetime.fromtimestamp(now_s, UTC)
    if period == "day":
        start = datetime(t.year, t.month, t.day, tzinfo=UTC).timestamp()
        return start, start + 86_400.0
    if period == "month":
        start_dt = datetime(t.year, t.month, 1, tzinfo=UTC)
        days = monthrange(t.year, t.month)[1]
        return start_dt.timestamp(), start_dt.timestamp() + days * 86_400.0
    raise ValueError(f"quota period {period!r} is not one of day, month")


_Bucket = tuple[str, str, int]  # (key id, model, minute)


@dataclass(slots=True)
class _Batch:
    seq: int
    rows: list[UsageRow]
    # Wall-clock time of its oldest record.
    oldest_at: float | None
    # Keys whose last_used_at this flush moves forward (key id -> epoch seconds).
    last_used: dict[str, float]


class UsageRecorder:
    """Batches usage in memory and writes it off the request path; see the module docstring.

    ``clock`` is wall-clock seconds (bucket minutes, quota periods).
    """

    def __init__(
        self,
        *,
        sessions: async_sessionmaker[AsyncSession],
        process_id: str | None = None,
        flush_interval_s: float = 1.0,
        flush_records: int = 1000,
        quota_refresh_s: float = 5.0,
        max_pending_buckets: int = 100_000,
        stop_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.process_id = process_id or new_process_id()
        self._sessions = sessions
        self._flush_records = flush_records
        self._quota_refresh_s = quota_refresh_s
        self._max_pending = max_pending_buckets
        self._stop_timeout_s = stop_timeout_s
        self._clock = clock
        # (key, model, minute) -> [requests, prompt, completion, cached], not yet in a batch.
        self._live: dict[_Bucket, list[int]] = {}
        # (key, model) -> the newest minute waiting in _live, where overflow goes.
        self._newest: dict[tuple[str, str], int] = {}
        self._live_records = 0
        self._batch: _Batch | None = None
        self._next_seq = 1
        # (key, period, period start) -> tokens recorded and not yet committed.
        self._unflushed: dict[tuple[str, str, float], int] = {}
        # (key, period, period start) -> tokens Postgres had (last read) + flushed since.
        self._totals: dict[tuple[str, str, float], int] = {}
        self._db_lock = asyncio.Lock()
        # Every flush_interval_s; woken early once flush_records wait (a wake-up also cuts a
        # failure's backoff short); after a failure, a growing pause.
        self._flusher = Periodic(
            self._flush_due,
            name="llmgw-usage-flush",
            interval_s=flush_interval_s,
            backoff=Backoff(_BACKOFF_BASE_S, _BACKOFF_MAX_S),
            on_error=self._flush_failed,
        )
        self._last_drop_log = 0.0
        self._last_totals_read = float("-inf")
        self.num_dropped = 0
        self.num_flushes = 0
        self.num_flush_failures = 0
        # Wall-clock time of the oldest record in _live.
        self._live_oldest_at: float | None = None
        # key id -> its latest record, and the time last written to api_keys.last_used_at
        # (written at most once a minute per key: it is an UPDATE of the key's row).
        self._last_used: dict[str, float] = {}
        self._touched: dict[str, float] = {}
        # The period starts of the last minute seen: record() computes them once a minute.
        self._starts_of: tuple[int, tuple[float, float]] = (-1, (0.0, 0.0))
        self.totals_loaded = False

    # --- the request path ---------------------------------------------------

    def record(
        self,
        key_id: str,
        model: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        requests: int = 1,
    ) -> None:
        """Add one request's usage; never blocks, never fails for Postgres."""
        counts = (requests, prompt_tokens, completion_tokens, cached_tokens)
        if min(counts) < 0:
            raise ValueError(f"usage counts must not be negative (got {counts})")
        now = self._clock()
        minute = int(now // 60) * 60
        bucket: _Bucket = (key_id, model, minute)
        acc = self._live.get(bucket)
        if acc is None:
            if len(self._live) >= self._max_pending:
                newest = self._newest.get((key_id, model))
                if newest is None:
                    self._drop(key_id, model, prompt_tokens + completion_tokens, now)
                    return
                bucket = (key_id, model, newest)
                acc = self._live[bucket]
            else:
                acc = self._live[bucket] = [0, 0, 0, 0]
                self._newest[(key_id, model)] = minute
        acc[0] += requests
        acc[1] += prompt_tokens
        acc[2] += completion_tokens
        acc[3] += cached_tokens
        tokens = prompt_tokens + completion_tokens
        # The bucket's minute, not now: a commit subtracts by the bucket's minute.
        for period, start in zip(_PERIODS, self._period_starts(bucket[2]), strict=True):
            slot = (key_id, period, start)
            self._unflushed[slot] = self._unflushed.get(slot, 0) + tokens
        if self._live_oldest_at is None:
            self._live_oldest_at = now
        self._last_used[key_id] = now
        self._live_records += 1
        if self._live_records >= self._flush_records:
            self._flusher.wake()

    def period_tokens(self, key_id: str, period: str, now_s: float | None = None) -> int:
        """Prompt + completion tokens of ``key_id`` in its current ``period`` (see the module
        docstring for what is counted)."""
        start = period_bounds(self._clock() if now_s is None else now_s, period)[0]
        slot = (key_id, period, start)
        return self._totals.get(slot, 0) + self._unflushed.get(slot, 0)

    @property
    def oldest_unflushed_at(self) -> float | None:
        """Wall-clock time of the oldest record not yet committed (None: nothing waits);
        now minus this is the flush lag."""
        times = [t for t in (self._live_oldest_at, self._batch and self._batch.oldest_at) if t]
        return min(times) if times else None

    @property
    def num_pending_buckets(self) -> int:
        return len(self._live) + (0 if self._batch is None else len(self._batch.rows))

    # --- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Read the quota totals (a failure is logged: quotas then count only this process's
        usage until a read succeeds) and start flushing in the background."""
        if self._flusher.started:
            return
        try:
            await self.refresh_totals()
        except Exception as exc:
            log.warning("usage_totals_read_failed", error=type(exc).__name__)
        self._flusher.start()

    async def stop(self) -> None:
        """Stop the background task and flush what is left, retrying for a bounded time."""
        await self._flusher.stop()
        deadline = time.monotonic() + self._stop_timeout_s
        failures = 0
        while self.num_pending_buckets:
            try:
                await self.flush()
            except Exception as exc:
                delay = backoff_delay(failures, _BACKOFF_BASE_S, _BACKOFF_MAX_S)
                if time.monotonic() + delay >= deadline:
                    self._log_lost(exc)
                    return
                await asyncio.sleep(delay)
                failures += 1

    async def flush(self) -> None:
        """Write everything recorded so far (the batch being retried first); raises when
        Postgres fails, keeping what was not written for the next try."""
        for _ in range(2):
            async with self._db_lock:
                batch = self._take_batch()
                if batch is None:
                    return
                await self._write(batch)

    async def refresh_totals(self) -> None:
        """Re-read the current day's and month's totals of every key with a quota."""
        now = self._clock()
        day_start = period_bounds(now, "day")[0]
        month_start = period_bounds(now, "month")[0]
        async with self._db_lock:
            async with self._sessions() as session:
                rows = await quota_totals(session, day_start=day_start, month_start=month_start)
            totals: dict[tuple[str, str, float], int] = {}
            for key_id, month_tokens, day_tokens in rows:
                totals[(key_id, "month", month_start)] = month_tokens
                totals[(key_id, "day", day_start)] = day_tokens
            self._totals = totals
        self._last_totals_read = time.monotonic()
        self.totals_loaded = True

    # --- internals ----------------------------------------------------------

    def _take_batch(self) -> _Batch | None:
        if self._batch is not None:
            return self._batch
        if not self._live:
            return None
        rows = [
            UsageRow(key_id, model, minute, *acc)
            for (key_id, model, minute), acc in self._live.items()
        ]
        last_used = {
            key_id: at
            for key_id, at in self._last_used.items()
            if at - self._touched.get(key_id, float("-inf")) >= _TOUCH_EVERY_S
        }
        self._batch = _Batch(
            seq=self._next_seq, rows=rows, oldest_at=self._live_oldest_at, last_used=last_used
        )
        self._live = {}
        self._newest = {}
        self._live_records = 0
        self._live_oldest_at = None
        self._next_seq += 1
        return self._batch

    async def _write(self, batch: _Batch) -> None:
        """One flush transaction; called with the lock held. After it, the batch is done
        (applied now or before) or kept for the next try."""
        try:
            applied = await self._commit(batch)
        except Exception:
            self.num_flush_failures += 1
            raise
        self._batch = None
        self.num_flushes += 1
        self._touched.update(batch.last_used)
        # Its tokens move from "not flushed" to the totals. (A totals read made while this
        # batch's outcome was unknown may already hold them: then they count twice until the
        # next read, a few seconds of refusing early, never of admitting too much.)
        for row in batch.rows:
            for period, start in zip(_PERIODS, self._period_starts(row.minute_s), strict=True):
                slot = (row.api_key_id, period, start)
                left = self._unflushed.get(slot, 0) - row.tokens
                if left > 0:
                    self._unflushed[slot] = left
                else:
                    self._unflushed.pop(slot, None)
                self._totals[slot] = self._totals.get(slot, 0) + row.tokens
        log.debug("usage_flushed", seq=batch.seq, buckets=len(batch.rows), replayed=not applied)

    async def _commit(self, batch: _Batch) -> bool:
        async with self._sessions() as session, session.begin():
            return await apply_flush(
                session,
                process_id=self.process_id,
                seq=batch.seq,
                rows=batch.rows,
                last_used=batch.last_used,
            )

    async def _flush_due(self) -> None:
        """The flusher's run: flush, and read the totals when they are due."""
        await self.flush()
        if time.monotonic() - self._last_totals_read >= self._quota_refresh_s:
            await self.refresh_totals()
        if self._flusher.failures:  # still the count of the failures before this run
            log.info("usage_flush_restored", failures=self._flusher.failures)

    def _flush_failed(self, exc: Exception, failures: int) -> None:
        if failures == 1:  # once per outage; the pending buckets show how it grows
            log.warning(
                "usage_flush_failed",
                error=type(exc).__name__,
                pending_buckets=self.num_pending_buckets,
            )

    def _period_starts(self, minute_s: int) -> tuple[float, float]:
        """(day start, month start) of ``minute_s``, in ``_PERIODS`` order."""
        if self._starts_of[0] != minute_s:
            starts = (period_bounds(minute_s, "day")[0], period_bounds(minute_s, "month")[0])
            self._starts_of = (minute_s, starts)
        return self._starts_of[1]

    def _drop(self, key_id: str, model: str, tokens: int, now: float) -> None:
        self.num_dropped += 1
        if now - self._last_drop_log >= _DROP_LOG_EVERY_S:
            self._last_drop_log = now
            log.error(
                "usage_dropped",
                key_id=key_id,
                model=model,
                tokens=tokens,
                dropped=self.num_dropped,
                max_pending_buckets=self._max_pending,
            )

    def _log_lost(self, exc: BaseException) -> None:
        rows = list(self._live_rows()) + ([] if self._batch is None else self._batch.rows)
        log.error(
            "usage_flush_lost",
            error=type(exc).__name__,
            buckets=len(rows),
            requests=sum(r.requests for r in rows),
            tokens=sum(r.tokens for r in rows),
        )

    def _live_rows(self) -> Iterable[UsageRow]:
        for (key_id, model, minute), acc in self._live.items():
            yield UsageRow(key_id, model, minute, *acc)
