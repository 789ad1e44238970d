"""Leader election and fencing against a real Postgres (docs/architecture.md §4).

Exactly one of several control planes holds the reconcile lock; a takeover bumps the
epoch; a leader whose lock died can never apply (check_epoch refuses its epoch); and an
apply already past its epoch check finishes before a takeover's bump, never interleaved.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from sqlalchemy import text

from llmgw.controlplane.reconcile.leader import FencedError, LeaderLock, check_epoch
from llmgw.embedded_postgres import libpq_url
from llmgw.store.database import create_engine, session_factory
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)


async def _terminate(url: str, application_name: str) -> None:
    """What a kill -9 of the leader's host looks like to Postgres: its backend goes away."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        )


async def test_exactly_one_leads_and_takeover_bumps_the_epoch(db_url: str) -> None:
    url = libpq_url(db_url)
    locks = [LeaderLock(url, instance_id=f"cp-{i}") for i in range(3)]
    try:
        epochs = await asyncio.gather(*(lock.try_acquire() for lock in locks))
        winners = [e for e in epochs if e is not None]
        assert len(winners) == 1, epochs
        leader = locks[epochs.index(winners[0])]
        others = [lock for lock in locks if lock is not leader]
        # Asking again changes nothing: the leader keeps its epoch, the others still lose.
        assert await leader.try_acquire() == winners[0]
        assert [await lock.try_acquire() for lock in others] == [None, None]

        await _terminate(url, f"llmgw-leader-{leader._instance_id}")
        assert not await leader.still_held()
        assert leader.epoch is None
        new_epochs = [await lock.try_acquire() for lock in others]
        assert [e for e in new_epochs if e is not None] == [winners[0] + 1]
    finally:
        for lock in locks:
            await lock.release()


async def test_a_stale_epoch_is_fenced(db_url: str) -> None:
    url = libpq_url(db_url)
    old, new = LeaderLock(url, instance_id="old"), LeaderLock(url, instance_id="new")
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        old_epoch = await old.try_acquire()
        assert old_epoch is not None
        async with sessions() as session, session.begin():
            await check_epoch(session, old_epoch)  # current: passes
        await old.release()
        new_epoch = await new.try_acquire()
        assert new_epoch == old_epoch + 1
        async with sessions() as session:
            with pytest.raises(FencedError, match="stale"):
                async with session.begin():
                    await check_epoch(session, old_epoch)
    finally:
        await old.release()
        await new.release()
        await engine.dispose()


async def test_takeover_waits_for_an_apply_past_its_check(db_url: str) -> None:
    url = libpq_url(db_url)
    old, new = LeaderLock(url, instance_id="old"), LeaderLock(url, instance_id="new")
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        old_epoch = await old.try_acquire()
        assert old_epoch is not None
        async with sessions() as session:
            await session.begin()
            await check_epoch(session, old_epoch)
            # The old leader loses its lock while its apply is in flight.
            await old.release()
            takeover = asyncio.create_task(new.try_acquire())
            # The bump blocks on the share lock: wait until Postgres shows it waiting.
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as probe:

                async def takeover_waits() -> bool:
                    row = await (
                        await probe.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                            "'llmgw-leader-new' AND wait_event_type = 'Lock'"
                        )
                    ).fetchone()
                    return bool(row and row[0] == 1)

                await until(
                    takeover_waits, timeout_s=4, what="the takeover to wait on the share lock"
                )
            assert not takeover.done()
            await session.execute(text("UPDATE leader SET holder = holder WHERE id = 1"))
            await session.commit()
        assert await asyncio.wait_for(takeover, 10) == old_epoch + 1
    finally:
        await old.release()
        await new.release()
        await engine.dispose()
