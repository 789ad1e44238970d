"""Dedicated connections to the state store, and the one LISTEN/NOTIFY loop of llmgw.

A *dedicated* connection is a psycopg connection of its own, never one borrowed from the
pool: the pool recycles and pre-pings its connections, which silently drops what a session
holds (a LISTEN, an advisory lock). Every one is opened by ``connect_dedicated``: autocommit,
a connect timeout, and TCP keepalives, so a peer that vanished is noticed in seconds.

``Listener`` LISTENs on its channels over such a connection and calls its owner back on every
notification; when the connection drops it reconnects with a growing pause. Notifications
sent while it was down are lost, so ``on_listening`` runs on every (re)connect, for owners
that then re-read what they hold.

What this module must NOT do: decide what a notification means (owners treat it as a hint
and re-read), or swallow anything but the driver's errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

__all__ = ["ListenLog", "Listener", "connect_dedicated"]

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


@dataclass(frozen=True, slots=True)
class ListenLog:
    """Where a listener logs, and its two events: the first failure of an outage (``lost``,
    with the error's type) and the connection that ends it (``restored``)."""

    logger: Any
    lost: str
    restored: str


class Listener:
    """LISTEN on ``channels`` until cancelled; see the module docstring.

    ``listening`` is set while the LISTEN is up: a NOTIFY sent from then on reaches
    ``on_notify``. ``log`` None: the owner logs nothing of the connection.
    """

    def __init__(
        self,
        libpq_url: str,
        channels: Sequence[str],
        *,
        application_name: str,
        on_notify: Callable[[], object],
        on_listening: Callable[[], object] | None = None,
        backoff_base_s: float,
        backoff_max_s: float,
        log: ListenLog | None = None,
    ) -> None:
        self._url = libpq_url
        self._channels = tuple(channels)
        self._application_name = application_name
        self._on_notify = on_notify
        self._on_listening = on_listening
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._log = log
        self.listening = asyncio.Event()

    async def run(self) -> None:
        """Listen, and reconnect after every drop, until the task running it is cancelled."""
        failures = 0
        while True:
            try:
                conn = await connect_dedicated(self._url, application_name=self._application_name)
                async with conn:
                    for channel in self._channels:
                        await conn.execute(f"LISTEN {channel}")
                    self.listening.set()
                    if failures and self._log is not None:
                        self._log.logger.info(self._log.restored)
                    failures = 0
                    if self._on_listening is not None:
                        self._on_listening()
                    async for _note in conn.notifies():
                        self._on_notify()
            except psycopg.Error as exc:
                failures += 1
                # Once per outage, not once per retry: the database being down is one fact.
                if failures == 1 and self._log is not None:
                    self._log.logger.warning(self._log.lost, error=type(exc).__name__)
            finally:
                self.listening.clear()
            await asyncio.sleep(min(self._backoff_max_s, self._backoff_base_s * 2**failures))
