"""Who may reconcile: a Postgres advisory lock plus an epoch that fences stale leaders.

Any number of control planes run against one Postgres; exactly one applies plans.
The advisory lock decides who leads. It is held on a DEDICATED connection with TCP
keepalives (``store.dedicated.connect_dedicated``), never one borrowed from the pool: the
pool recycles and pre-pings its connections, and a recycled connection silently drops a
session-level advisory lock, so two processes would both believe they lead.

The lock alone is not enough. A leader paused (GC, SIGSTOP, a partitioned network)
can lose its lock while it still holds a plan computed from old state; when it wakes,
it would apply that plan over the new leader's work. So every takeover bumps
``leader.epoch``, and every apply transaction first runs ``check_epoch``: it reads the
epoch ``FOR SHARE`` and refuses to write if it is not its own. The share lock also
orders the two writers: a takeover's epoch bump waits until an apply already past its
check has committed, so an apply either happened entirely before the takeover or not
at all.

This module must NOT decide what to apply; it only answers "may I write now?".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.errors import ConflictError
from llmgw.logs import get_logger
from llmgw.store.dedicated import connect_dedicated

__all__ = ["RECONCILE_LOCK_KEY", "FencedError", "LeaderLock", "check_epoch"]

log = get_logger("llmgw.controlplane.leader")

# A fixed 63-bit key every control plane of a cluster agrees on; derived from a name so it
# does not collide with advisory locks other software might take in the same database.
RECONCILE_LOCK_KEY = int.from_bytes(hashlib.sha256(b"llmgw/reconcile").digest()[:8], "big") >> 1


class FencedError(ConflictError):
    """This process's leadership epoch is no longer current: another control plane took over."""

    code = "fenced"


async def check_epoch(session: AsyncSession, epoch: int) -> None:
    """Raise FencedError unless ``epoch`` is still the leader's epoch.

    Call it first inside the transaction that applies a plan; the row stays share-locked
    until that transaction ends, so no takeover can interleave with the writes after it.
    """
    current = (
        await session.execute(text("SELECT epoch FROM leader WHERE id = 1 FOR SHARE"))
    ).scalar_one()
    if current != epoch:
        raise FencedError(
            f"leadership epoch {epoch} is stale (the current epoch is {current}): another "
            "control plane took over, so this plan is discarded",
            field="epoch",
        )


class LeaderLock:
    """The reconcile lock of one control plane process.

    Usage::

        lock = LeaderLock(libpq_url, instance_id="cp-1")
        epoch = await lock.try_acquire()     # None: someone else leads
        ...
        if not await lock.still_held(): ...  # lost it: stop applying at once
        await lock.release()
    """

    def __init__(self, libpq_url: str, *, instance_id: str, connect_timeout_s: float = 5.0) -> None:
        self._url = libpq_url
        self._instance_id = instance_id
        self._connect_timeout_s = connect_timeout_s
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._epoch: int | None = None
        self._acquire_failing = False

    @property
    def epoch(self) -> int | None:
        """The epoch this process leads under, or None when it does not lead."""
        return self._epoch

    async def try_acquire(self) -> int | None:
        """Take the lock if it is free and bump the epoch; return the new epoch or None."""
        if self._epoch is not None and await self.still_held():
            return self._epoch
        try:
            conn = await self._connect()
            got = await (
                await conn.execute("SELECT pg_try_advisory_lock(%s)", (RECONCILE_LOCK_KEY,))
            ).fetchone()
            if not got or not got[0]:
                return None
            row = await (
                await conn.execute(
                    "UPDATE leader SET epoch = epoch + 1, holder = %s, acquired_at = now() "
                    "WHERE id = 1 RETURNING epoch",
                    (self._instance_id,),
                )
            ).fetchone()
        except psycopg.Error as exc:
            # Once per outage, not once per tick: the database being down is one fact.
            if not self._acquire_failing:
                log.warning("leader_acquire_failed", error=type(exc).__name__)
            self._acquire_failing = True
            await self._drop()
            return None
        if self._acquire_failing:
            log.info("leader_acquire_restored", instance=self._instance_id)
            self._acquire_failing = False
        if row is None:
            # The singleton row is created by the first migration; without it nothing is fenced.
            await self._drop()
            raise ConflictError(
                "the leader row is missing from the state store; run `llmgw db upgrade`",
                field="leader",
            )
        self._epoch = int(row[0])
        log.info("leader_acquired", instance=self._instance_id, epoch=self._epoch)
        return self._epoch

    async def still_held(self) -> bool:
        """True while the lock's connection is alive (the lock dies with it)."""
        conn = self._conn
        if conn is None or conn.closed:
            self._lost("connection closed")
            return False
        try:
            await asyncio.wait_for(conn.execute("SELECT 1"), timeout=self._connect_timeout_s)
        except (psycopg.Error, TimeoutError) as exc:
            self._lost(type(exc).__name__)
            await self._drop()
            return False
        return self._epoch is not None

    async def release(self) -> None:
        """Give up leadership now (SIGTERM): a standby takes over without waiting for timeouts."""
        if self._conn is not None and not self._conn.closed and self._epoch is not None:
            try:
                await self._conn.execute("SELECT pg_advisory_unlock(%s)", (RECONCILE_LOCK_KEY,))
                log.info("leader_released", instance=self._instance_id, epoch=self._epoch)
            except psycopg.Error:
                pass  # closing the connection below releases it all the same
        self._epoch = None
        await self._drop()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await connect_dedicated(
                self._url,
                application_name=f"llmgw-leader-{self._instance_id}",
                connect_timeout_s=self._connect_timeout_s,
            )
        return self._conn

    def _lost(self, why: str) -> None:
        if self._epoch is not None:
            log.warning("leader_lost", instance=self._instance_id, epoch=self._epoch, why=why)
        self._epoch = None

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.close()
