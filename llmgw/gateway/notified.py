"""A gateway cache of something in Postgres, re-read at once on a NOTIFY and every
``refresh_s`` as a safety net, that keeps the last good copy while Postgres is down (fail
static: the gateway serves with what it read).

The routes and the tokenizer files are two such caches; each says how to ``refresh`` and how
many things it ``holds`` (for the log line that says it recovered). Every (re)connect of the
LISTEN connection wakes a refresh too: NOTIFYs sent while no one listened are not replayed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from llmgw.eventloop import cancel_and_wait, wait_event
from llmgw.logs import get_logger
from llmgw.store.listen import Listener

__all__ = ["NotifiedCache"]

log = get_logger("llmgw.gateway")

_LISTEN_BACKOFF_BASE_S = 0.1
_LISTEN_BACKOFF_MAX_S = 5.0


class NotifiedCache:
    def __init__(
        self,
        what: str,
        *,
        libpq_url: str | None,
        channels: Sequence[str],
        refresh_s: float,
    ) -> None:
        self._what = what  # names the log events: gateway_<what>_refresh_failed / _restored
        self.refresh_s = refresh_s
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._failing = False
        self._listener = (
            None
            if not libpq_url
            else Listener(
                libpq_url,
                list(channels),
                application_name=f"llmgw-gateway-{what.replace('_', '-')}",
                on_notify=self._wake.set,
                on_listening=self._wake.set,
                backoff_base_s=_LISTEN_BACKOFF_BASE_S,
                backoff_max_s=_LISTEN_BACKOFF_MAX_S,
            )
        )
        # Set while the LISTEN connection is up: NOTIFYs sent from then on reach this cache.
        # Without a listener, never.
        self.listening = asyncio.Event() if self._listener is None else self._listener.listening

    async def refresh(self) -> None:
        raise NotImplementedError

    def holds(self) -> int:
        raise NotImplementedError

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
            if self._failing:
                log.info(f"gateway_{self._what}_restored", held=self.holds())
            self._failing = False
        except Exception as exc:  # the database may be down: keep serving what we hold
            if not self._failing:
                log.warning(f"gateway_{self._what}_refresh_failed", error=type(exc).__name__)
            self._failing = True

    async def start(self) -> None:
        await self._refresh_quietly()
        self._tasks.append(asyncio.create_task(self._run(), name=f"gateway-{self._what}"))
        if self._listener is not None:
            self._tasks.append(
                asyncio.create_task(self._listener.run(), name=f"gateway-{self._what}-listen")
            )

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)

    async def _run(self) -> None:
        while True:
            await wait_event(self._wake, self.refresh_s)
            self._wake.clear()
            await self._refresh_quietly()
