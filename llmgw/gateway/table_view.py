"""The route table as the request path reads it: the route cache's latest, each new table shown
first to what depends on it.

A new table (the cache swaps in a new object when it re-reads) goes to flow control (the
replicas' admission ceilings, the routes queues drain into) and to the trees: the claims on a
replica whose engine restarted since the last table are forgotten. A new engine process has an
empty KV cache; until its blocks' events reach the index, and for the approximate tier at all,
the trees would still send the restarted replica every prompt it was once sent, to recompute
it.

What it must NOT do: read the store (the cache does), or hold a table past the next one.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.gateway.flow import FlowControl
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.gateway.routing.approx import ApproxTree
from llmgw.gateway.routing.inputs import RestartWatch
from llmgw.logs import get_logger

__all__ = ["TableView"]

log = get_logger("llmgw.gateway")


class TableView:
    """``source``: the route cache's table as it stands; ``trees``: the approximate tree and
    the claims (``computing``), each forgetting a restarted replica."""

    def __init__(
        self,
        source: Callable[[], RouteTable],
        *,
        flow: FlowControl,
        trees: tuple[ApproxTree, ...],
        clock: Callable[[], float],
    ) -> None:
        self._source = source
        self._flow = flow
        self._trees = trees
        self._clock = clock
        self._seen: RouteTable | None = None
        self._restarts = RestartWatch()

    def current(self) -> RouteTable:
        """The table, a new one shown to flow control and the trees first."""
        table = self._source()
        if table is self._seen:
            return table
        self._seen = table
        self._flow.configure(table)
        now = self._clock()
        endpoints = (ep for route in table.routes.values() for ep in route.endpoints)
        for replica in self._restarts.restarted(endpoints):
            for tree in self._trees:
                tree.forget(replica, now=now)
            log.info("gateway_replica_restarted", replica=replica)
        return table

    def route(self, model: str) -> ModelRoute | None:
        return self.current().get(model)

    def ready_endpoints(self) -> list[Endpoint]:
        """Every ready replica once (a replica serving several names is listed under each):
        what the load scrape reads."""
        seen: dict[str, Endpoint] = {}
        for route in self._source().routes.values():
            for ep in route.endpoints:
                seen.setdefault(ep.replica, ep)
        return list(seen.values())
