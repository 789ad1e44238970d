"""The agent's shared proxy: the one place engines are still served from the agent process.

Every shard this agent starts has a front door of its own (frontdoor.py, served by its
wrapper). A leader adopted from a wrapper started by an older agent, which served every
engine's proxy itself, has none: ``SharedProxy`` serves such leaders on agent.proxy_port,
only when the agent's start found one, and only once the control plane has given each its
key. Once those shards have been restarted nothing is served from here.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.engines.engine import host_port
from llmgw.http.listeners import ListenerLimits
from llmgw.logs import get_logger
from llmgw.nodeagent.prepare import PreparedShard
from llmgw.nodeagent.proxy import EngineProxy, ProxyRoute
from llmgw.nodeagent.records import ShardRecord
from llmgw.nodeagent.runtime import ShardRuntime

__all__ = ["SharedProxy", "served_by_agent"]

log = get_logger("llmgw.nodeagent")


def served_by_agent(rec: ShardRecord) -> bool:
    """A leader serving HTTP whose record has no front door port: started by an agent that
    served every engine's proxy itself (an agent that allocates front doors gives every such
    leader one, or none when it has no key, and then no proxy may serve it either)."""
    return rec.proxy_port == 0 and rec.http_port > 0 and rec.spec_view.leader


class SharedProxy:
    """The shared proxy on ``host``:``port`` (0: any), started only when a shard needs it."""

    def __init__(self, host: str, port: int, *, metrics_token: str) -> None:
        self._host = host
        self._want_port = port
        self._metrics_token = metrics_token
        self._proxy: EngineProxy | None = None
        self.port = 0
        # The routes last handed to the proxy, by shard id.
        self._routes: dict[str, ProxyRoute] = {}

    async def start(self, runtimes: Mapping[str, ShardRuntime], limits: ListenerLimits) -> None:
        """Serve, when this start found shards that need it: leaders whose wrappers serve no
        front door (``served_by_agent``)."""
        legacy = sorted(
            sid
            for sid, rt in runtimes.items()
            if rt.phase in ("unadopted", "live") and served_by_agent(rt.record)
        )
        if not legacy:
            return
        self._proxy = EngineProxy(
            self._host, self._want_port, metrics_token=self._metrics_token, limits=limits
        )
        self.port = await self._proxy.start()
        log.warning(
            "shared_proxy_serving_adopted_shards",
            shards=legacy,
            port=self.port,
            hint="these shards were started by an older agent and have no front door of their "
            "own; they move to one at their next restart",
        )

    def url(self, shard_id: str, rt: ShardRuntime, *, desired_known: bool) -> str:
        """http://<host>:<port>/shards/<shard_id> for a shard this proxy serves, else "".
        ``desired_known``: the control plane has given the desired set since the agent started."""
        if self._proxy is None or not served_by_agent(rt.record):
            return ""
        # Before the first desired set after a restart the proxy holds no keys (they come with
        # it), yet adopted engines are ready: reporting no URL then takes every engine of this
        # node out of the gateways' routes until the next sync (issue #12's fault suite saw a
        # sync period of 503s per agent restart). The routes follow within moments of that
        # sync's reply; until then the proxy's 404 not-found makes a gateway retry elsewhere.
        if shard_id not in self._routes and desired_known:
            return ""
        return f"http://{host_port(self._host, self.port)}/shards/{shard_id}"

    def update_routes(
        self,
        runtimes: Mapping[str, ShardRuntime],
        desired: Mapping[str, PreparedShard] | None,
    ) -> None:
        """Expose every ready leader adopted from a wrapper that serves no front door, once the
        control plane has given its key (after an agent restart, only once the first sync
        brought the keys back)."""
        if self._proxy is None:
            return
        routes: dict[str, ProxyRoute] = {}
        for sid, rt in runtimes.items():
            d = (desired or {}).get(sid)
            if (
                served_by_agent(rt.record)
                and rt.proxy_port == 0
                and rt.phase == "live"
                and rt.health == "ready"
                and d is not None
                and d.digest == rt.record.digest
                and d.desired.engine_api_key
            ):
                routes[sid] = ProxyRoute(rt.record.http_port, d.desired.engine_api_key)
        if routes != self._routes:
            self._proxy.set_routes(routes)
            self._routes = routes

    async def stop(self) -> None:
        if self._proxy is not None:
            await self._proxy.stop()
