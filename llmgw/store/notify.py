"""The process's one LISTEN connection: ``NotifyHub`` fans notifications out to subscribers.

Every owner of something it re-reads on a NOTIFY (the gateway's key, route and tokenizer-file
caches, the reconciler) subscribes here, with the channels it cares about and a callback; the
hub holds one dedicated connection (``store.dedicated``) that LISTENs on the union of their
channels, so a control plane process holds one LISTEN connection however many owners it has
(docs/architecture.md §3).

When the connection drops the hub reconnects with a growing pause, logging one warning per
outage and one info line when it is back. Notifications sent while it was down are lost, so
every subscriber's ``on_connect`` runs once its channels are listened again (and on its first
LISTEN): owners re-read what they hold then. A subscription made while the hub is connected
is LISTENed at once on the live connection, and its ``on_connect`` runs then too.

What this module must NOT do: decide what a notification means (owners treat it as a hint
and re-read), or swallow anything but the driver's errors (a callback must not raise: they
only set an event).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg import sql

from llmgw.eventloop import cancel_and_wait
from llmgw.logs import get_logger
from llmgw.periodic import backoff_delay
from llmgw.store.dedicated import connect_dedicated

__all__ = ["NotifyHub", "Subscription"]

log = get_logger("llmgw.store.notify")


class Subscription:
    """One owner's channels and callbacks, made once by the owner and added to the hub while
    it runs. ``listening`` is set while all its channels are LISTENed on the hub's connection:
    a NOTIFY sent from then on reaches ``on_notify``."""

    __slots__ = ("channels", "listening", "on_connect", "on_notify")

    def __init__(
        self,
        channels: Iterable[str],
        on_notify: Callable[[], object],
        *,
        on_connect: Callable[[], object] | None = None,
    ) -> None:
        self.channels = frozenset(channels)
        self.on_notify = on_notify
        # Runs every time the channels are listened (again): after the first LISTEN and after
        # every reconnect, when what was sent meanwhile is lost.
        self.on_connect = on_connect
        self.listening = asyncio.Event()


class NotifyHub:
    """LISTEN for every subscriber over one connection, from ``start`` until ``stop``.

    ``listening`` is set while the connection is up (a subscription's own ``listening`` says
    when its channels are listened). ``application_name`` names the connection in
    ``pg_stat_activity``.
    """

    def __init__(
        self,
        libpq_url: str,
        *,
        application_name: str,
        backoff_base_s: float = 0.1,
        backoff_max_s: float = 5.0,
    ) -> None:
        self._url = libpq_url
        self.application_name = application_name
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._subs: list[Subscription] = []
        self._listened: set[str] = set()  # on the current connection
        self._changed = asyncio.Event()  # a subscription came while connected
        self._task: asyncio.Task[None] | None = None
        self.listening = asyncio.Event()

    def add(self, sub: Subscription) -> None:
        """Call ``sub`` back from now on; its channels are LISTENed at once if connected."""
        if sub not in self._subs:
            self._subs.append(sub)
            self._changed.set()

    def remove(self, sub: Subscription) -> None:
        """No more callbacks for ``sub``. Its channels stay listened until the next reconnect:
        a NOTIFY nobody wants is dropped here."""
        if sub in self._subs:
            self._subs.remove(sub)
        sub.listening.clear()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"notify-{self.application_name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def __aenter__(self) -> NotifyHub:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    async def run(self) -> None:
        """Listen, and reconnect after every drop, until the task running it is cancelled."""
        failures = 0
        while True:
            try:
                conn = await connect_dedicated(self._url, application_name=self.application_name)
                async with conn:
                    if failures:
                        log.info("notify_listen_restored", connection=self.application_name)
                    failures = 0
                    await self._serve(conn)
            except psycopg.Error as exc:
                failures += 1
                # Once per outage, not once per retry: the database being down is one fact.
                if failures == 1:
                    log.warning(
                        "notify_listen_lost",
                        connection=self.application_name,
                        error=type(exc).__name__,
                    )
            finally:
                self._listened = set()
                self.listening.clear()
                for sub in self._subs:
                    sub.listening.clear()
            await asyncio.sleep(backoff_delay(failures, self._backoff_base_s, self._backoff_max_s))

    async def _serve(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """LISTEN what is subscribed and dispatch notifications; when a subscription comes in,
        stop reading (``notifies`` holds the connection), LISTEN its channels and read on."""
        while True:
            await self._catch_up(conn)
            reader = asyncio.create_task(self._read(conn), name="notify-read")
            changed = asyncio.create_task(self._changed.wait(), name="notify-changed")
            try:
                await asyncio.wait({reader, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait([t for t in (reader, changed) if not t.done()])
            if not reader.cancelled():
                # The driver's error: the connection is gone. ``notifies`` without a timeout
                # ends only by raising; should it return, the connection is as good as gone.
                raise reader.exception() or psycopg.OperationalError("the LISTEN read ended")

    async def _catch_up(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # Cleared first: a subscription arriving during the LISTENs below wakes the loop again.
        self._changed.clear()
        pending = [sub for sub in self._subs if not sub.listening.is_set()]
        for channel in sorted({c for sub in pending for c in sub.channels} - self._listened):
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            self._listened.add(channel)
        self.listening.set()
        for sub in pending:
            if sub in self._subs:
                sub.listening.set()
                if sub.on_connect is not None:
                    sub.on_connect()

    async def _read(self, conn: psycopg.AsyncConnection[Any]) -> None:
        async for note in conn.notifies():
            for sub in tuple(self._subs):
                if note.channel in sub.channels:
                    sub.on_notify()
