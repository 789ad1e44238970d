"""UsageRecorder against a real Postgres: rows equal what was recorded, flushes are
idempotent, nothing is lost while Postgres is away, stop() flushes, memory stays bounded."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy.exc import OperationalError
from structlog.testing import capture_logs

from llmgw.embedded_postgres import libpq_url
from llmgw.gateway.accounting import UsageRecorder
from llmgw.store.usage import UsageRow, apply_flush
from tests.gateway.keys_testkit import insert_key, sessions_on
from tests.pg_harness import PgServer
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)

# 2026-11-15 12:00:30 UTC: half a minute into a minute, mid-day, mid-month.
T0 = datetime(2026, 11, 15, 12, 0, 30, tzinfo=UTC).timestamp()


def _rows(db_url: str) -> dict[tuple[str, str, datetime], tuple[int, int, int, int]]:
    with psycopg.connect(libpq_url(db_url)) as conn:
        cur = conn.execute(
            "SELECT api_key_id, model, bucket_start, requests, prompt_tokens, "
            "completion_tokens, cached_tokens FROM usage_buckets"
        )
        return {(k, m, s): (r, p, c, ca) for k, m, s, r, p, c, ca in cur.fetchall()}


def _scalar(db_url: str, query: str, params: tuple[Any, ...] = ()) -> Any:
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute(query, params).fetchone()
        return None if row is None else row[0]


def _minute(offset_min: int) -> datetime:
    return datetime.fromtimestamp((int(T0 // 60) + offset_min) * 60, UTC)


async def test_rows_equal_what_was_recorded(db_url: str) -> None:
    now = [T0]
    async with sessions_on(db_url) as sessions:
        a, _ = await insert_key(sessions, "a")
        b, _ = await insert_key(sessions, "b")
        rec = UsageRecorder(sessions=sessions, clock=lambda: now[0], process_id="gw-1")
        rec.record(a, "m1", prompt_tokens=10, completion_tokens=5, cached_tokens=4)
        rec.record(a, "m1", prompt_tokens=7, completion_tokens=1, cached_tokens=0)
        rec.record(a, "m2", prompt_tokens=3, completion_tokens=3, cached_tokens=3, requests=2)
        rec.record(b, "m1", prompt_tokens=1, completion_tokens=0, cached_tokens=0)
        now[0] += 60  # the next minute is its own bucket
        rec.record(a, "m1", prompt_tokens=100, completion_tokens=50, cached_tokens=20)
        assert rec.oldest_unflushed_at == T0
        await rec.flush()
        assert rec.num_pending_buckets == 0 and rec.oldest_unflushed_at is None
        assert _rows(db_url) == {
            (a, "m1", _minute(0)): (2, 17, 6, 4),
            (a, "m2", _minute(0)): (2, 3, 3, 3),
            (b, "m1", _minute(0)): (1, 1, 0, 0),
            (a, "m1", _minute(1)): (1, 100, 50, 20),
        }
        # last_used_at: the latest record's time, written at most once a minute per key.
        last_used = "SELECT last_used_at FROM api_keys WHERE id = %s"
        assert _scalar(db_url, last_used, (a,)).timestamp() == T0 + 60
        assert _scalar(db_url, last_used, (b,)).timestamp() == T0
        # A later flush into the same bucket adds to it.
        now[0] += 10
        rec.record(a, "m1", prompt_tokens=1, completion_tokens=1, cached_tokens=1)
        await rec.flush()
        assert _rows(db_url)[(a, "m1", _minute(1))] == (2, 101, 51, 21)
        assert _scalar(db_url, last_used, (a,)).timestamp() == T0 + 60  # not a minute yet
        now[0] += 50
        rec.record(a, "m1", prompt_tokens=0, completion_tokens=0, cached_tokens=0, requests=0)
        await rec.flush()
        assert _scalar(db_url, last_used, (a,)).timestamp() == T0 + 120
        # The process keeps only its latest flush row.
        assert _scalar(db_url, "SELECT array_agg(flush_seq) FROM usage_flushes") == [3]


async def test_replaying_a_flush_sequence_counts_once(db_url: str) -> None:
    async with sessions_on(db_url) as sessions:
        key, _ = await insert_key(sessions, "k")
        rows = [UsageRow(key, "m", int(T0 // 60) * 60, 1, 10, 2, 0)]
        results = []
        for _ in range(2):
            async with sessions() as session, session.begin():
                results.append(await apply_flush(session, process_id="p", seq=7, rows=rows))
        assert results == [True, False]
        # Another process's seq 7 is its own flush.
        async with sessions() as session, session.begin():
            assert await apply_flush(session, process_id="q", seq=7, rows=rows)
        assert _rows(db_url) == {(key, "m", _minute(0)): (2, 20, 4, 0)}


async def test_a_flush_whose_commit_reply_was_lost_is_retried_and_counted_once(
    db_url: str,
) -> None:
    async with sessions_on(db_url) as sessions:
        key, _ = await insert_key(sessions, "k")
        rec = UsageRecorder(sessions=sessions, clock=lambda: T0)
        real_commit = rec._commit
        lost = [True]

        async def commit_then_lose_reply(batch: Any) -> bool:
            applied = await real_commit(batch)
            if lost.pop() if lost else False:
                raise OperationalError("COMMIT", {}, Exception("server closed the connection"))
            return applied

        rec._commit = commit_then_lose_reply  # type: ignore[method-assign]
        rec.record(key, "m", prompt_tokens=10, completion_tokens=1, cached_tokens=0)
        with pytest.raises(OperationalError):
            await rec.flush()
        assert rec.num_pending_buckets == 1 and rec.num_flush_failures == 1
        # Recorded while the outcome is unknown: goes to the next batch, never into this one.
        rec.record(key, "m", prompt_tokens=5, completion_tokens=0, cached_tokens=0)
        await rec.flush()
        assert rec.num_pending_buckets == 0
        assert _rows(db_url) == {(key, "m", _minute(0)): (2, 15, 1, 0)}
        assert rec.period_tokens(key, "day", T0) == 16


async def test_usage_recorded_while_postgres_is_away_is_flushed_when_it_returns(
    db_url: str, pg_server: PgServer
) -> None:
    async with sessions_on(db_url) as sessions:
        key, _ = await insert_key(sessions, "k", quota=10**6)
        rec = UsageRecorder(sessions=sessions, flush_interval_s=0.1, quota_refresh_s=0.1)
        await rec.start()
        try:
            rec.record(key, "m", prompt_tokens=1, completion_tokens=1, cached_tokens=0)
            await until(lambda: rec.num_pending_buckets == 0, timeout_s=10, what="first flush")
            with capture_logs() as logs, pg_server.offline(db_url):
                for _ in range(50):
                    rec.record(key, "m", prompt_tokens=2, completion_tokens=3, cached_tokens=1)
                await until(lambda: rec.num_flush_failures >= 1, timeout_s=10, what="a failure")
                assert rec.num_pending_buckets >= 1
                assert rec.period_tokens(key, "month") == 2 + 50 * 5
            assert "usage_flush_failed" in [e["event"] for e in logs]
            await until(lambda: rec.num_pending_buckets == 0, timeout_s=15, what="catch-up")
            total = _scalar(
                db_url,
                "SELECT array[sum(requests), sum(prompt_tokens), sum(completion_tokens), "
                "sum(cached_tokens)] FROM usage_buckets WHERE api_key_id = %s",
                (key,),
            )
            assert total == [51, 101, 151, 50]
        finally:
            await rec.stop()


async def test_stop_flushes_what_is_left(db_url: str) -> None:
    async with sessions_on(db_url) as sessions:
        key, _ = await insert_key(sessions, "k")
        # The periodic flush never comes: only stop() can write this.
        rec = UsageRecorder(sessions=sessions, flush_interval_s=3600, clock=lambda: T0)
        await rec.start()
        rec.record(key, "m", prompt_tokens=3, completion_tokens=4, cached_tokens=0)
        await asyncio.sleep(0)
        assert _rows(db_url) == {}
        await rec.stop()
        assert _rows(db_url) == {(key, "m", _minute(0)): (1, 3, 4, 0)}


async def test_stop_says_what_it_could_not_write(db_url: str, pg_server: PgServer) -> None:
    async with sessions_on(db_url) as sessions:
        key, _ = await insert_key(sessions, "k")
        rec = UsageRecorder(sessions=sessions, flush_interval_s=3600, stop_timeout_s=0.5)
        rec.record(key, "m", prompt_tokens=3, completion_tokens=4, cached_tokens=0)
        with capture_logs() as logs, pg_server.offline(db_url):
            await rec.stop()
        lost = [e for e in logs if e["event"] == "usage_flush_lost"]
        assert len(lost) == 1 and (lost[0]["requests"], lost[0]["tokens"]) == (1, 7)


async def test_many_records_flush_early_and_unknown_keys_do_not_block_the_rest(
    db_url: str,
) -> None:
    async with sessions_on(db_url) as sessions:
        key, _ = await insert_key(sessions, "k")
        rec = UsageRecorder(sessions=sessions, flush_interval_s=3600, flush_records=10)
        await rec.start()
        try:
            rec.record("0000000000000000", "m", prompt_tokens=9, completion_tokens=9,
                       cached_tokens=0)  # fmt: skip
            for _ in range(9):
                rec.record(key, "m", prompt_tokens=1, completion_tokens=0, cached_tokens=0)
            await until(lambda: _rows(db_url), timeout_s=10, what="a flush by count")
            assert list(_rows(db_url).values()) == [(9, 9, 0, 0)]
            # The poll above blocks the loop: the rows can be seen before the flush has read
            # its COMMIT's reply, so "nothing pending" is waited for, not read at once.
            await until(lambda: rec.num_pending_buckets == 0, timeout_s=5, what="none pending")
        finally:
            await rec.stop()


async def test_memory_is_bounded_and_overflow_keeps_totals(db_url: str) -> None:
    now = [T0]
    async with sessions_on(db_url) as sessions:
        a, _ = await insert_key(sessions, "a")
        b, _ = await insert_key(sessions, "b")
        rec = UsageRecorder(sessions=sessions, max_pending_buckets=2, clock=lambda: now[0])
        rec.record(a, "m", prompt_tokens=1, completion_tokens=0, cached_tokens=0)
        now[0] += 60
        rec.record(a, "m", prompt_tokens=2, completion_tokens=0, cached_tokens=0)
        now[0] += 60  # full: this minute goes into a's newest bucket
        rec.record(a, "m", prompt_tokens=4, completion_tokens=0, cached_tokens=0)
        with capture_logs() as logs:
            rec.record(b, "m", prompt_tokens=8, completion_tokens=0, cached_tokens=0)
            rec.record(b, "m", prompt_tokens=8, completion_tokens=0, cached_tokens=0)
        assert rec.num_pending_buckets == 2 and rec.num_dropped == 2
        assert [e["event"] for e in logs] == ["usage_dropped"]  # rate-limited, once
        await rec.flush()
        assert _rows(db_url) == {
            (a, "m", _minute(0)): (1, 1, 0, 0),
            (a, "m", _minute(1)): (2, 6, 0, 0),
        }


async def test_period_tokens_see_other_gateways_after_a_refresh(db_url: str) -> None:
    now = [T0]
    async with sessions_on(db_url) as sessions:
        key, _ = await insert_key(sessions, "q", quota=1000, period="day")
        gw1 = UsageRecorder(sessions=sessions, clock=lambda: now[0])
        gw2 = UsageRecorder(sessions=sessions, clock=lambda: now[0])
        gw1.record(key, "m", prompt_tokens=100, completion_tokens=20, cached_tokens=0)
        assert gw1.period_tokens(key, "day") == 120 and gw2.period_tokens(key, "day") == 0
        await gw1.flush()
        assert gw1.period_tokens(key, "day") == 120  # moved from unflushed to totals
        gw2.record(key, "m", prompt_tokens=5, completion_tokens=0, cached_tokens=0)
        await gw2.refresh_totals()
        assert gw2.period_tokens(key, "day") == 125
        assert gw2.period_tokens(key, "month") == 125
        # Both flush into the same bucket: summed, not overwritten.
        await asyncio.gather(gw2.flush(), gw1.refresh_totals())
        assert _rows(db_url)[(key, "m", _minute(0))] == (2, 105, 20, 0)
        # Tomorrow the day's count starts again; the month's does not.
        now[0] += 86_400
        await gw1.refresh_totals()
        assert gw1.period_tokens(key, "day") == 0
        assert gw1.period_tokens(key, "month") == 125
