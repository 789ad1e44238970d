"""The gateway's life: what starts before the first request and stops after the last, and the
stats loop between.

Start, in order: the upstream session (the load scrape and the /tokenize client share it), the
parts handed in (``starts``: keys, usage recorder, route and tokenizer caches, demand report),
the load scrape, the first route table, the models' tokenizer files, flow control's ticker
(which re-reads the table, so held requests see a woken replica), then the stats loop. Stop, in
reverse, once uvicorn has let open streams finish: the stats loop, flow control (queued
requests cancelled), the scrape, the parts handed in (``stops``, in reverse: the usage
recorder's stop is its final flush, after the last stream ended), the session, the tokenizer
threads.

The stats loop, every 2 s: the approximate tree's size, the KV index's blocks per model, the
tokenizer files synced and each model's tokenizer mode reported.

What it must NOT do: serve requests, or let a failed stop keep the others from stopping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from starlette.types import Receive, Send

from llmgw.config import GatewaySettings
from llmgw.eventloop import cancel_and_wait
from llmgw.gateway.flow import FlowControl
from llmgw.gateway.load import LoadTracker
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routing.approx import ApproxTree
from llmgw.gateway.routing.inputs import KvView
from llmgw.gateway.table_view import TableView
from llmgw.gateway.tokens import Tokens
from llmgw.gateway.upstream import Upstream
from llmgw.logs import get_logger

__all__ = ["Lifespan"]

log = get_logger("llmgw.gateway")

_STATS_S = 2.0


class Lifespan:
    def __init__(
        self,
        settings: GatewaySettings,
        *,
        upstream: Upstream,
        tokens: Tokens,
        load: LoadTracker,
        flow: FlowControl,
        table: TableView,
        tree: ApproxTree,
        intake: KvView | None,
        metrics: GatewayMetrics,
        starts: Sequence[Callable[[], Awaitable[None]]],
        stops: Sequence[Callable[[], Awaitable[None]]],
    ) -> None:
        self._settings = settings
        self._upstream = upstream
        self._tokens = tokens
        self._load = load
        self._flow = flow
        self._table = table
        self._tree = tree
        self._intake = intake
        self._metrics = metrics
        self._starts = starts
        self._stops = stops
        self._stats_task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        http = self._upstream.open()
        self._tokens.open(http)
        for start in self._starts:
            await start()
        await self._load.start(http, self._table.ready_endpoints, self._settings.load_scrape_s)
        self._table.current()
        self._tokens.sync()
        await self._flow.start(refresh=self._table.current)
        self._stats_task = asyncio.create_task(self._stats(), name="gateway-stats")

    async def shutdown(self) -> None:
        # uvicorn has stopped accepting and let open streams finish (controlplane grace) by now.
        await cancel_and_wait(self._stats_task)
        await self._flow.stop()
        await self._load.stop()
        for stop in reversed(self._stops):
            try:
                await stop()
            except Exception:
                log.error("gateway_stop_failed", exc_info=True)
        await self._upstream.close()
        self._tokens.close()

    async def serve(self, receive: Receive, send: Send) -> None:
        """The ASGI lifespan protocol: start on its startup message, stop on its shutdown."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.error("gateway_start_failed", exc_info=True)
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _stats(self) -> None:
        while True:
            await asyncio.sleep(_STATS_S)
            self._metrics.approx_entries.set(len(self._tree))
            self._tokens.sync()
            self._tokens.report_modes()
            if self._intake is not None:
                index = self._intake.index
                for model in index.models():
                    self._metrics.index_blocks.labels(model).set(index.num_entries(model))
