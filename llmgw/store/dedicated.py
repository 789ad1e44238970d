"""Dedicated connections to the state store.

A *dedicated* connection is a psycopg connection of its own, never one borrowed from the
pool: the pool recycles and pre-pings its connections, which silently drops what a session
holds (a LISTEN, an advisory lock). Every one is opened by ``connect_dedicated``: autocommit,
a connect timeout, and TCP keepalives, so a peer that vanished is noticed in seconds. Two
hold one each: the process's LISTEN connection (``store.notify``) and the reconcile leader's
lock (``controlplane.reconcile.leader``).
"""

from __future__ import annotations

from typing import Any

import psycopg

__all__ = ["connect_dedicated"]

# A dead peer is noticed in about idle + interval * count seconds instead of the kernel's
# two hours: a leader whose host vanished loses its lock, and a listener reconnects, within
# seconds, not hours.
_KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}
# Postgres truncates longer names; done here, so every caller sees the name it will get.
_MAX_APPLICATION_NAME = 63


async def connect_dedicated(
    libpq_url: str, *, application_name: str, connect_timeout_s: float = 5.0
) -> psycopg.AsyncConnection[Any]:
    """A new autocommit connection with a connect timeout and TCP keepalives."""
    return await psycopg.AsyncConnection.connect(
        libpq_url,
        autocommit=True,
        connect_timeout=max(1, int(connect_timeout_s)),
        application_name=application_name[:_MAX_APPLICATION_NAME],
        **_KEEPALIVES,
    )
