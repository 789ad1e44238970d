"""A gateway cache of something in Postgres, re-read at once on a NOTIFY and every
``refresh_s`` as a safety net, that keeps the last good copy while Postgres is down (fail
static: the gateway serves with what it read).

The keys, the routes and the tokenizer files are such caches; each says how to ``refresh``
(raising when it cannot: the old copy stays) and how many things it ``holds`` (for the log
line that says it recovered). The NOTIFYs come through the process's ``NotifyHub``: every
(re)connect of its LISTEN connection wakes a refresh too, since NOTIFYs sent while no one
listened are not replayed. A refresh that failed is retried with a growing pause (at most
``refresh_s``), so the cache catches up soon after Postgres answers again.

Logs, under ``log_as``: ``<log_as>_load_failed`` when the first read at start fails,
``<log_as>_refresh_failed`` once per outage after that, ``<log_as>_restored`` when a read
succeeds again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from llmgw.eventloop import cancel_and_wait, wait_event
from llmgw.logs import get_logger
from llmgw.periodic import backoff_delay
from llmgw.store.notify import NotifyHub, Subscription

__all__ = ["NotifiedCache"]

log = get_logger("llmgw.gateway")

# A failed refresh is retried after base * 2**failures seconds, at most this (or refresh_s).
_RETRY_BASE_S = 0.25
_RETRY_MAX_S = 5.0
# Reads that ``catch_up`` asks for start at least this far apart: a client naming things that
# do not exist costs the database at most a few reads a second per process, however fast it asks.
_CATCH_UP_GAP_S = 0.25


class NotifiedCache:
    """``notify`` None: no NOTIFYs, only the period (``listening`` is then never set)."""

    def __init__(
        self,
        what: str,
        *,
        notify: NotifyHub | None,
        channels: Sequence[str],
        refresh_s: float,
        log_as: str | None = None,
    ) -> None:
        self._what = what  # names the task
        self._log_as = log_as or f"gateway_{what}"
        self.refresh_s = refresh_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self._notify = notify
        self._subscription = Subscription(channels, self._wake.set, on_connect=self._wake.set)
        # Set while the hub LISTENs on this cache's channels: NOTIFYs sent from then on reach it.
        self.listening = self._subscription.listening
        self._read_started = float("-inf")  # time.monotonic() when the last read began
        self._catching_up: asyncio.Task[None] | None = None

    @property
    def failing(self) -> bool:
        """Whether the last read failed: the cache serves its last good copy."""
        return self._failures > 0

    async def refresh(self) -> None:
        raise NotImplementedError

    def holds(self) -> int:
        raise NotImplementedError

    async def catch_up(self) -> None:
        """Return once a read that began after this call has finished (or failed): for a
        lookup that missed, since the NOTIFY of a change committed just before it may not have
        been read yet (an adapter applied, then asked for at once). Concurrent callers share
        one read, and such reads start at least ``_CATCH_UP_GAP_S`` apart."""
        asked = time.monotonic()
        while self._read_started < asked:
            if self._catching_up is None or self._catching_up.done():
                self._catching_up = asyncio.create_task(
                    self._catch_up_read(), name=f"gateway-{self._what}-catch-up"
                )
            # Shielded: one caller going away (a client hung up) does not cancel the others' read.
            await asyncio.shield(self._catching_up)

    async def _catch_up_read(self) -> None:
        wait = self._read_started + _CATCH_UP_GAP_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        await self._refresh_quietly()

    async def _refresh_quietly(self, *, first: bool = False) -> None:
        self._read_started = time.monotonic()
        try:
            await self.refresh()
        except Exception as exc:  # the database may be down: keep serving what we hold
            if not self._failures:
                event = "load_failed" if first else "refresh_failed"
                log.warning(f"{self._log_as}_{event}", error=type(exc).__name__, held=self.holds())
            self._failures += 1
            return
        if self._failures:
            log.info(f"{self._log_as}_restored", held=self.holds())
        self._failures = 0

    async def start(self) -> None:
        """Read once (a failure is logged, not raised: the loop retries), then follow the
        NOTIFYs and the period in the background."""
        if self._task is not None:
            return
        await self._refresh_quietly(first=True)
        if self._notify is not None:
            self._notify.add(self._subscription)
        self._task = asyncio.create_task(self._run(), name=f"gateway-{self._what}")

    async def stop(self) -> None:
        if self._notify is not None:
            self._notify.remove(self._subscription)
        task, self._task = self._task, None
        await cancel_and_wait(task)
        catching_up, self._catching_up = self._catching_up, None
        await cancel_and_wait(catching_up)

    def _pause_s(self) -> float:
        if not self._failures:
            return self.refresh_s
        return backoff_delay(self._failures, _RETRY_BASE_S, min(self.refresh_s, _RETRY_MAX_S))

    async def _run(self) -> None:
        while True:
            await wait_event(self._wake, self._pause_s())
            # Cleared before reading: a change committed during the read wakes us again.
            self._wake.clear()
            await self._refresh_quietly()
