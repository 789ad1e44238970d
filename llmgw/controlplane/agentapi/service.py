"""One process's agent API: its handlers, caches and background loops, started and stopped
together.

Background loops (each in its own short transactions, each surviving a database outage):
the batched heartbeat flush, this instance's row in ``controlplane_instances`` with the
live list, the node table (credentials, approval, desired versions: ``nodes.py``) and the
placed-shard map the KV path reads.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.config import AgentApiSettings
from llmgw.controlplane.agentapi.heartbeats import HeartbeatBatcher
from llmgw.controlplane.agentapi.kv_endpoint import KvHandler
from llmgw.controlplane.agentapi.metrics import AgentApiMetrics
from llmgw.controlplane.agentapi.nodes import LookupThrottled, NodeTable
from llmgw.controlplane.agentapi.placed import PlacedCache
from llmgw.controlplane.agentapi.register import RegisterHandler
from llmgw.controlplane.agentapi.sync import SyncHandler
from llmgw.controlplane.instances import InstanceHeartbeat
from llmgw.errors import AuthError, DatabaseUnavailableError, TooManyRequestsError
from llmgw.kv.shard_views import ShardViews
from llmgw.logs import get_logger
from llmgw.periodic import Periodic
from llmgw.ratelimit import TokenBucket
from llmgw.store.agent_nodes import read_cluster_id
from llmgw.store.credentials import NodeCredential, hash_matches
from llmgw.store.instances import InstanceIdentity

__all__ = ["AgentApi"]

log = get_logger("llmgw.controlplane.agentapi")


class AgentApi:
    def __init__(
        self,
        *,
        settings: AgentApiSettings,
        sessions: async_sessionmaker[AsyncSession],
        instance: InstanceIdentity,
        registry: CollectorRegistry,
        intake: ShardViews | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.metrics = AgentApiMetrics.create(registry)
        # The gateway's router reads this intake's index: pass the shared one in.
        self.intake = intake if intake is not None else ShardViews()
        self.instances = InstanceHeartbeat(
            sessions, instance, period_s=settings.instance_heartbeat_s
        )
        self.heartbeats = HeartbeatBatcher(
            sessions, period_s=settings.heartbeat_flush_s, metrics=self.metrics
        )
        self.placed = PlacedCache(sessions, self.intake, refresh_s=settings.placed_refresh_s)
        self.nodes = NodeTable(
            sessions,
            refresh_s=settings.node_refresh_s,
            background_s=settings.placed_refresh_s,
            unknown_lookups=TokenBucket(
                rate_per_s=settings.unknown_node_rate_per_s, burst=settings.unknown_node_burst
            ),
        )
        self.kv = KvHandler(
            self.intake,
            self.placed,
            TokenBucket(
                rate_per_s=settings.kv_full_copy_rate_per_s, burst=settings.kv_full_copy_burst
            ),
            self.metrics,
        )
        self._sync: SyncHandler | None = None
        self._register: RegisterHandler | None = None
        # Until the handlers start (the database was unreachable at start): a try a second.
        self._retry = Periodic(self._retry_handlers, name="agent-api-start", interval_s=1.0)

    @property
    def sync(self) -> SyncHandler:
        if self._sync is None:
            raise _starting()
        return self._sync

    @property
    def register(self) -> RegisterHandler:
        if self._register is None:
            raise _starting()
        return self._register

    async def start(self) -> None:
        """Start the loops and handlers. A database unreachable at start does not fail the
        process (its other listeners, health and admin API, must come up to say so): the
        agent API answers 503 until a retry in the background reaches it."""
        await self.instances.start()
        await self.nodes.start()
        await self.placed.start()
        await self.heartbeats.start()
        try:
            await self._start_handlers()
        except (OperationalError, InterfaceError, OSError) as exc:
            log.warning("agent_api_waiting_for_database", error=type(exc).__name__)
            self._retry.start()

    async def _retry_handlers(self) -> None:
        try:
            await self._start_handlers()
        except (OperationalError, InterfaceError, OSError):
            return  # still unreachable: the next try in a second (other errors are logged)
        self._retry.finish()

    async def _start_handlers(self) -> None:
        async with self.sessions() as session, session.begin():
            cluster_id = await read_cluster_id(session)
        self._sync = SyncHandler(
            self.sessions,
            cluster_id=cluster_id,
            heartbeats=self.heartbeats,
            instances=self.instances,
            placed=self.placed,
            nodes=self.nodes,
            metrics=self.metrics,
        )
        self._register = RegisterHandler(
            self.sessions, cluster_id=cluster_id, metrics=self.metrics, nodes=self.nodes
        )
        log.info(
            "agent_api_started",
            instance=self.instances.identity.id,
            cluster_id=cluster_id,
            internal_url=self.instances.identity.internal_url,
        )

    async def stop(self) -> None:
        await self._retry.stop()
        self._sync = self._register = None
        await self.heartbeats.stop()
        await self.placed.stop()
        await self.nodes.stop()
        await self.instances.stop()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[AgentApi]:
        await self.start()
        try:
            yield self
        finally:
            await self.stop()

    async def authenticate(self, credential: NodeCredential, *, endpoint: str) -> None:
        """Check a node credential from the headers, before any body is read.

        From ``NodeTable`` when the node is known; sync (``endpoint="sync"``) falls back to
        the node's row for a node not in it yet (registered a moment ago), or to the ids
        read as unknown moments ago. The KV path never queries: an unknown node is refused,
        and a refresh (rate-limited) picks it up for its retry.
        """
        if endpoint == "sync":
            # Not ``cached``: its refresh of the whole table on a miss buys sync nothing
            # (``lookup`` reads the one row), and forged ids would keep it running.
            node = self.nodes.nodes.get(credential.node_id)
            if node is None:
                try:
                    node = await self.nodes.lookup(credential.node_id)
                except LookupThrottled as exc:
                    self.metrics.auth_failures.labels(endpoint, "lookups_throttled").inc()
                    raise _throttled(exc.retry_after_s) from None
        else:
            node = self.nodes.cached(credential.node_id)
        stored = None if node is None else node.credential_hash
        if not hash_matches(credential.secret, stored):
            reason = "unknown_node" if stored is None else "wrong_credential"
            self.metrics.auth_failures.labels(endpoint, reason).inc()
            raise unauthorized(credential.node_id)


def unauthorized(node_id: uuid.UUID | None = None) -> AuthError:
    who = "" if node_id is None else f" for node {node_id}"
    return AuthError(
        f"missing or wrong node credential{who}: send `Authorization: Bearer llmgwn_...` "
        "as registration returned it; a deleted node registers again with a bootstrap token",
    )


def _throttled(retry_after_s: float) -> TooManyRequestsError:
    return TooManyRequestsError(
        "too many syncs from node ids this control plane does not hold; retry after the "
        "Retry-After seconds (a registered node is held after its first sync; if real nodes "
        "are refused, raise controlplane.agent_api.unknown_node_rate_per_s)",
        retry_after_s=retry_after_s,
    )


def _starting() -> DatabaseUnavailableError:
    return DatabaseUnavailableError("the agent API is starting; retry in a moment")
