"""This control plane process in ``controlplane_instances``, and the list of live ones.

Agents feed KV deltas to *every* live instance (docs/architecture.md §5), and learn the list from sync
responses, so each process registers itself with its internal URL, heartbeats every
``period_s`` and is listed while seen within ``LIVE_PERIODS`` periods: a crashed process
drops off the list within seconds without anyone deleting it. A clean shutdown deletes
the row at once.

``InstanceHeartbeat`` is the shell that runs the SQL (``store/instances.py``) on a timer in
its own short transactions and keeps the latest list in memory, so a sync response never
queries for it.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.logs import get_logger
from llmgw.periodic import Periodic
from llmgw.protocol.sync import ControlPlaneInstance
from llmgw.store.instances import (
    InstanceIdentity,
    list_live_instances,
    remove_instance,
    upsert_instance,
)

# InstanceIdentity is listed because InstanceHeartbeat takes one: it is this shell's API too.
__all__ = [
    "GATEWAY_ID_PREFIX",
    "LIVE_PERIODS",
    "InstanceHeartbeat",
    "InstanceIdentity",
    "is_gateway",
    "listener_url",
    "new_instance_id",
]

log = get_logger("llmgw.controlplane.instances")

# Seen within this many heartbeat periods: one missed beat (a GC pause, a slow commit) must
# not drop a live instance, three mean it is gone.
LIVE_PERIODS = 3


# A `llmgw gateway` process's row: agents relay KV deltas to it like to any instance, and a
# control plane tells it apart by this prefix (to read its metrics, never to act as a peer).
GATEWAY_ID_PREFIX = "gateway-"


def new_instance_id(*, gateway: bool = False) -> str:
    """host-pid-random: readable in logs, unique across restarts (the pid may be reused);
    ``gateway``: with ``GATEWAY_ID_PREFIX``."""
    host = socket.gethostname().split(".", 1)[0][:40] or "host"
    return f"{GATEWAY_ID_PREFIX if gateway else ''}{host}-{os.getpid()}-{secrets.token_hex(3)}"


def is_gateway(instance_id: str) -> bool:
    return instance_id.startswith(GATEWAY_ID_PREFIX)


def listener_url(host: str, port: int) -> str:
    """Where agents reach a listener bound to ``host:port``: a wildcard is where we listen, not
    where anyone can reach us, so this machine's name stands in for it."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


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
        self._beats = Periodic(
            self.beat,
            name="controlplane-instance-heartbeat",
            interval_s=period_s,
            on_error=self._beat_failed,
        )

    async def beat(self) -> Sequence[ControlPlaneInstance]:
        async with self.sessions() as session, session.begin():
            # The upsert: a row someone deleted (a sweep) comes back with the next beat.
            await upsert_instance(session, self.identity)
            live = await list_live_instances(session, within_s=self.period_s * LIVE_PERIODS)
        if live:
            self.live = live
        return self.live

    async def start(self) -> None:
        try:
            await self.beat()
        except Exception as exc:  # the database may be down at start: the timer retries
            self._beat_failed(exc, 1)
        self._beats.start()

    def _beat_failed(self, exc: Exception, _failures: int) -> None:
        # The database may be down: keep the last list, beat again next period.
        log.warning("instance_heartbeat_failed", instance=self.identity.id, error=repr(exc))

    async def stop(self) -> None:
        """Stop beating and remove the row, so agents stop feeding this process at once."""
        await self._beats.stop()
        try:
            async with self.sessions() as session, session.begin():
                await remove_instance(session, self.identity.id)
        except Exception as exc:  # shutting down with the database gone: the row just ages out
            log.warning("instance_remove_failed", instance=self.identity.id, error=repr(exc))
