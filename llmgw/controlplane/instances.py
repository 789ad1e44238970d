"""This control plane process in ``controlplane_instances``, and the list of live ones.

Agents feed KV deltas to *every* live instance (design §5), and learn the list from sync
responses, so each process registers itself with its internal URL, heartbeats every
``period_s`` and is listed while seen within ``LIVE_PERIODS`` periods: a crashed process
drops off the list within seconds without anyone deleting it. A clean shutdown deletes
the row at once.

The SQL functions take a session and never commit; ``InstanceHeartbeat`` is the shell that
runs them on a timer in its own short transactions and keeps the latest list in memory, so
a sync response never queries for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.logs import get_logger
from llmgw.protocol.sync import MAX_INSTANCES, ControlPlaneInstance

__all__ = [
    "LIVE_PERIODS",
    "InstanceHeartbeat",
    "InstanceIdentity",
    "heartbeat_instance",
    "list_live_instances",
    "new_instance_id",
    "remove_instance",
    "upsert_instance",
]

log = get_logger("llmgw.controlplane.instances")

# Seen within this many heartbeat periods: one missed beat (a GC pause, a slow commit) must
# not drop a live instance, three mean it is gone.
LIVE_PERIODS = 3


@dataclass(frozen=True, slots=True)
class InstanceIdentity:
    id: str
    # Where agents reach this process's internal listener (its agent API).
    internal_url: str


def new_instance_id() -> str:
    """host-pid-random: readable in logs, unique across restarts (the pid may be reused)."""
    host = socket.gethostname().split(".", 1)[0][:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


async def upsert_instance(session: AsyncSession, identity: InstanceIdentity) -> None:
    await session.execute(
        text(
            "INSERT INTO controlplane_instances (id, internal_url) VALUES (:id, :url) "
            "ON CONFLICT (id) DO UPDATE SET internal_url = EXCLUDED.internal_url, "
            "last_seen_at = now()"
        ),
        {"id": identity.id, "url": identity.internal_url},
    )


async def heartbeat_instance(session: AsyncSession, identity: InstanceIdentity) -> None:
    """Mark the instance seen now; re-creates the row if someone (a sweep) deleted it."""
    await upsert_instance(session, identity)


async def list_live_instances(
    session: AsyncSession, *, within_s: float
) -> tuple[ControlPlaneInstance, ...]:
    result = await session.execute(
        text(
            "SELECT id, internal_url FROM controlplane_instances "
            "WHERE last_seen_at > now() - make_interval(secs => :within) "
            "ORDER BY id LIMIT :limit"
        ),
        {"within": within_s, "limit": MAX_INSTANCES},
    )
    return tuple(ControlPlaneInstance(id=r.id, internal_url=r.internal_url) for r in result)


async def remove_instance(session: AsyncSession, instance_id: str) -> None:
    await session.execute(
        text("DELETE FROM controlplane_instances WHERE id = :id"), {"id": instance_id}
    )


class InstanceHeartbeat:
    """Registers this process, beats every ``period_s``, and holds the live list in memory."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        identity: InstanceIdentity,
        *,
        period_s: float = 3.0,
    ) -> None:
        self.sessions = sessions
        self.identity = identity
        self.period_s = period_s
        # Until the first beat lands, at least this instance: agents must never be told
        # "feed nobody".
        self.live: tuple[ControlPlaneInstance, ...] = (
            ControlPlaneInstance(id=identity.id, internal_url=identity.internal_url),
        )
        self._task: asyncio.Task[None] | None = None

    async def beat(self) -> Sequence[ControlPlaneInstance]:
        async with self.sessions() as session, session.begin():
            await heartbeat_instance(session, self.identity)
            live = await list_live_instances(session, within_s=self.period_s * LIVE_PERIODS)
        if live:
            self.live = live
        return self.live

    async def start(self) -> None:
        try:
            await self.beat()
        except Exception as exc:  # the database may be down at start: the loop retries
            log.warning("instance_heartbeat_failed", instance=self.identity.id, error=repr(exc))
        self._task = asyncio.create_task(self._run(), name="controlplane-instance-heartbeat")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.beat()
            except Exception as exc:  # the database may be down: keep the last list, retry
                log.warning("instance_heartbeat_failed", instance=self.identity.id, error=repr(exc))

    async def stop(self) -> None:
        """Stop beating and remove the row, so agents stop feeding this process at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            async with self.sessions() as session, session.begin():
                await remove_instance(session, self.identity.id)
        except Exception as exc:  # shutting down with the database gone: the row just ages out
            log.warning("instance_remove_failed", instance=self.identity.id, error=repr(exc))
