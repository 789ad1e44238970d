"""Sync (docs/architecture.md §5): apply what an agent observed, answer with what its node should run.

Rules, each with the failure it prevents:

- **Order.** A report is applied only when its (agent_epoch, seq) is newer than the node's
  stored order (and than any this process accepted and has not flushed yet). A delayed
  request of an earlier agent run, or a retried duplicate, must never overwrite a newer
  report: it is answered, but writes nothing. A new agent run starts a higher epoch, so its
  seq 0 is newer than anything of the previous run.
- **Own shards only.** Bindings are written with ``WHERE node_id = <the credential's node>``:
  a node cannot write another node's shards (those bindings are counted and ignored), and it
  only ever receives its own shards.
- **Unchanged syncs write nothing but a heartbeat.** Same desired_version (the ETag), the
  same bindings this process last applied for the node, no inventory: the only write is the
  heartbeat, batched (``HeartbeatBatcher``). If another instance wrote the node's state since
  (its stored order is past what this process knows), the cached bindings are dropped, so a
  report is never skipped on the strength of a stale cache. With the node table in memory
  that takes a refresh between the other instance's write and this node's next sync here,
  which ``node_refresh_s`` below the agents' sync interval (0.5 s vs 2 s) provides.
- **Released.** A shard desired ``stopped`` that the agent reports ``exited``/``failed``, or no
  longer reports at all (agents report every shard they know, every sync), is released: its
  GPUs and leader port are free, and the node's desired_version is bumped so the agent drops
  it from its set. Applied only with an in-order report from an agent that has applied the
  node's current desired set (so it has seen the stop), in the same transaction.
- **confirmed_drain** is true when an admin drains the node, or when every engine the agent
  reports alive is a shard the control plane knows on this node: then each stop in the set is
  an explicit ``desired_state=stopped`` the reconciler wrote (a deletion, a scale-down, a
  rollout), not a shard missing from a truncated set or a restored database, which the
  agent's "never stop more than half" valve exists for.
- **Runtime adapters.** A rank-0 shard's desired set carries the adapters the leader placed on
  its engine (``shards.desired_adapters``), beside its spec and never in it: the leader bumps
  the node's desired_version with them, so the agent gets them through the ETag like any
  change, while the spec's digest (what restarts an engine) stays the same. The adapters an
  agent reports are stored only where they changed (``apply_observed_adapters``).
- **Pending nodes** get ``approval_state=pending`` and no shards (None, not an empty set: an
  agent keeps what it runs). Their inventory is stored, so an admin can see what to approve.

Unchanged syncs are decided from ``NodeTable`` (the node rows in memory, re-read every
``node_refresh_s``: see its docstring for the staleness this allows); every sync that writes
re-reads the node's row in its transaction and re-checks the credential there.

The HTTP shell (``router.py``) authenticates and parses before calling ``SyncHandler.sync``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.controlplane.agentapi.heartbeats import HeartbeatBatcher
from llmgw.controlplane.agentapi.metrics import AgentApiMetrics
from llmgw.controlplane.agentapi.nodes import NodeTable
from llmgw.controlplane.agentapi.placed import PlacedCache
from llmgw.controlplane.instances import InstanceHeartbeat
from llmgw.errors import AuthError
from llmgw.logs import get_logger
from llmgw.protocol.sync import (
    DesiredShard,
    RuntimeAdapter,
    ShardBinding,
    SyncRequest,
    SyncResponse,
)
from llmgw.store.agent_nodes import (
    SyncNode,
    bump_desired_version,
    read_sync_node,
    record_sync_order,
)
from llmgw.store.agent_shards import (
    GONE_STATES,
    DesiredShardRow,
    PlacedRow,
    apply_bindings,
    apply_observed_adapters,
    kv_capacity_blocks,
    read_desired_shards,
    read_live_shard_ids,
    release_stopped_shards,
    stopped_shards_gone,
)
from llmgw.store.credentials import NodeCredential, hash_matches
from llmgw.store.database import RETRYABLE_SQLSTATES, sqlstate_of

__all__ = ["SyncHandler", "desired_shard", "placed_row"]

log = get_logger("llmgw.controlplane.agentapi")

_ATTEMPTS = 3

Order = tuple[int, int]


@dataclass(slots=True)
class _NodeMemo:
    """What this process knows of one node beyond its row: never a source of truth, only of
    "nothing changed since I last wrote"."""

    # The newest (epoch, seq) this process accepted (written or queued as a heartbeat).
    order: Order = (-1, -1)
    # The bindings it last applied, sorted by shard id; None: unknown, apply the next ones.
    bindings: tuple[ShardBinding, ...] | None = None
    # (desired_version, live shard ids) as last read.
    desired: tuple[int, frozenset[uuid.UUID]] | None = None


def _sorted_bindings(bindings: tuple[ShardBinding, ...]) -> tuple[ShardBinding, ...]:
    return tuple(sorted(bindings, key=lambda b: b.shard_id))


def _has_applied(request: SyncRequest, version: int) -> bool:
    """Whether the agent says it applied this desired_version (the wire carries it as text;
    the node's row holds an int, compared as one)."""
    text = request.desired_version
    return text is not None and text.isascii() and text.isdigit() and int(text) == version


def _parse_uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def desired_shard(row: DesiredShardRow) -> DesiredShard:
    """A shard row as the agent receives it: the launch spec with its identity and devices.

    The devices come from gpu_assignments, the one record of who holds which GPU (docs/architecture.md §3),
    whatever the stored spec says: ``gpu_indices`` by position and, when any device is a MIG
    instance, ``gpu_uuids`` in the same order (CUDA addresses an instance only by its UUID).
    The API key travels in ``engine_api_key``, never inside the spec.
    """
    spec = dict(row.launch_spec)
    spec.pop("api_key", None)
    spec["shard_id"] = str(row.id)
    spec["replica_id"] = str(row.replica_id)
    spec["rank"] = row.rank
    spec["gpu_indices"] = list(row.gpu_indices)
    if any(m is not None for m in row.mig_uuids):
        spec["gpu_uuids"] = [m or "" for m in row.mig_uuids]
    else:
        spec.pop("gpu_uuids", None)
    return DesiredShard(
        shard_id=str(row.id),
        replica_id=str(row.replica_id),
        rank=row.rank,
        desired_state=row.desired_state,
        fingerprint=row.fingerprint,
        spec=spec,
        engine_api_key=row.engine_api_key,
        model=row.model,
        adapters=_runtime_adapters(row),
    )


def _runtime_adapters(row: DesiredShardRow) -> tuple[RuntimeAdapter, ...]:
    """The stored desired adapters as the wire's; an entry that is not one (written by a
    newer leader, say) is left out rather than failing the node's whole sync."""
    out = []
    for item in row.adapters:
        try:
            out.append(RuntimeAdapter.model_validate(item))
        except ValueError:
            log.warning("desired_adapter_unreadable", shard=str(row.id))
    return tuple(out)


def placed_row(node_id: uuid.UUID, row: DesiredShardRow) -> PlacedRow:
    """The KV intake's view of a desired shard (see ``store.agent_shards.read_placed``)."""
    profile = row.launch_spec.get("profile")
    block_size: int | None = None
    if isinstance(profile, dict) and profile.get("kv_events") is True:
        kv_hash = profile.get("kv_hash")
        size = kv_hash.get("block_size") if isinstance(kv_hash, dict) else None
        block_size = size if isinstance(size, int) and not isinstance(size, bool) else None
    capacity = kv_capacity_blocks(profile) if isinstance(profile, dict) else None
    return PlacedRow(row.id, node_id, row.model, block_size, capacity)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Applied:
    # The node's row as read in the transaction, with the version and order it left.
    node: SyncNode
    in_order: bool
    version: int
    rows: list[DesiredShardRow] | None
    live_ids: frozenset[uuid.UUID] | None
    released: list[uuid.UUID]
    foreign: int
    # A stopped shard is gone but the report came from an agent behind the current set:
    # released on its next report, which must therefore not be answered from memory.
    release_deferred: bool = False


class SyncHandler:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        cluster_id: str,
        heartbeats: HeartbeatBatcher,
        instances: InstanceHeartbeat,
        placed: PlacedCache,
        nodes: NodeTable,
        metrics: AgentApiMetrics,
    ) -> None:
        self.sessions = sessions
        self.nodes = nodes
        self.cluster_id = cluster_id
        self.heartbeats = heartbeats
        self.instances = instances
        self.placed = placed
        self.metrics = metrics
        self._memo: dict[uuid.UUID, _NodeMemo] = {}

    def forget(self, node_id: uuid.UUID) -> None:
        self._memo.pop(node_id, None)

    async def sync(self, credential: NodeCredential, request: SyncRequest) -> SyncResponse:
        started = time.perf_counter()
        result, response = await self._sync(credential, request)
        self.metrics.syncs.labels(result).inc()
        if result == "changed":
            # The access line of a sync is debug (one every ~2 s per node); what a sync changed
            # is worth its own info line. An unchanged one is counted, not logged.
            log.info(
                "node_sync_changed",
                node=str(credential.node_id),
                desired_version=response.desired_version,
                shards=len(request.bindings),
            )
        self.metrics.sync_seconds.labels(result).observe(time.perf_counter() - started)
        return response

    async def _sync(
        self, credential: NodeCredential, request: SyncRequest
    ) -> tuple[str, SyncResponse]:
        node_id = credential.node_id
        at = datetime.now(UTC)
        node = await self.nodes.lookup(node_id)
        if node is None or not hash_matches(credential.secret, node.credential_hash):
            self.forget(node_id)
            raise self._revoked(node_id)
        memo = self._memo.setdefault(node_id, _NodeMemo())
        stored: Order = (node.agent_epoch, node.agent_seq)
        if stored > memo.order:
            # Another instance (or a restart) wrote this node since: the cache says nothing.
            memo.bindings = None
            memo.desired = None
            memo.order = stored
        order: Order = (request.agent_epoch, request.seq)
        newer = order > memo.order
        bindings = _sorted_bindings(request.bindings)

        if node.approval_state != "approved":
            if newer:
                await self._write_order_only(node_id, request, at, memo)
            return "pending" if newer else "stale", self._response(
                node, approval="pending", version=None
            )

        same_version = _has_applied(request, node.desired_version)
        if same_version and request.inventory is None and memo.bindings == bindings:
            if newer:
                memo.order = order
                self.heartbeats.record(node_id, epoch=order[0], seq=order[1], at=at)
            drain = node.draining or await self._knows_all(
                node.id, node.desired_version, memo, bindings
            )
            return "unchanged" if newer else "stale", self._response(
                node, approval="approved", version=node.desired_version, drain=drain
            )

        applied = await self._apply(credential, request, bindings, at, newer)
        node = applied.node
        self.nodes.put(node)
        if applied.in_order:
            memo.order = max(memo.order, order)
            # Only a report on the current set may serve as the fast path's baseline: one
            # from an agent behind it released nothing (it had not seen the stops), and if
            # its next, identical report were answered from memory, a stopped shard already
            # gone would never be released.
            memo.bindings = None if applied.release_deferred else bindings
        if node.approval_state != "approved":
            return "pending", self._response(node, approval="pending", version=None)
        if applied.live_ids is not None:
            memo.desired = (applied.version, applied.live_ids)
        if applied.rows is not None:
            self.placed.set_node(node_id, (placed_row(node_id, r) for r in applied.rows))
        if applied.foreign:
            self.metrics.foreign_bindings.inc(applied.foreign)
            log.warning("sync_foreign_bindings", node=str(node_id), count=applied.foreign)
        if applied.released:
            self.metrics.shards_released.inc(len(applied.released))
            log.info(
                "shards_released",
                node=str(node_id),
                shards=[str(s) for s in applied.released],
                desired_version=applied.version,
            )
        drain = node.draining or await self._knows_all(node.id, applied.version, memo, bindings)
        unchanged = _has_applied(request, applied.version)
        response = SyncResponse(
            cluster_id=self.cluster_id,
            instance_id=self.instances.identity.id,
            instances=self.instances.live,
            approval_state="approved",
            desired_version=str(applied.version),
            unchanged=unchanged,
            shards=None
            if unchanged or applied.rows is None
            else tuple(desired_shard(r) for r in applied.rows),
            confirmed_drain=drain,
        )
        return "changed" if applied.in_order else "stale", response

    def _revoked(self, node_id: uuid.UUID) -> AuthError:
        self.metrics.auth_failures.labels("sync", "unknown_or_revoked").inc()
        return AuthError(
            f"node {node_id} has no such credential (deleted, or registered again); "
            "register the agent again with a bootstrap token",
        )

    def _response(
        self, node: SyncNode, *, approval: str, version: int | None, drain: bool = False
    ) -> SyncResponse:
        return SyncResponse(
            cluster_id=self.cluster_id,
            instance_id=self.instances.identity.id,
            instances=self.instances.live,
            approval_state=approval,
            desired_version=None if version is None else str(version),
            unchanged=version is not None,
            shards=None,
            confirmed_drain=drain,
        )

    async def _knows_all(
        self,
        node_id: uuid.UUID,
        version: int,
        memo: _NodeMemo,
        bindings: tuple[ShardBinding, ...],
    ) -> bool:
        """See confirmed_drain in the module docstring; reads the node's shard ids only when
        this process has not seen its set at ``version`` (after a restart, say)."""
        if memo.desired is None or memo.desired[0] != version:
            async with self.sessions() as session, session.begin():
                ids = await read_live_shard_ids(session, node_id)
            memo.desired = (version, ids)
        return _knows_all_ids(memo.desired[1], bindings)

    async def _write_order_only(
        self, node_id: uuid.UUID, request: SyncRequest, at: datetime, memo: _NodeMemo
    ) -> None:
        """A pending node's sync: a heartbeat, or its inventory stored for the admin."""
        order: Order = (request.agent_epoch, request.seq)
        if request.inventory is None:
            memo.order = order
            self.heartbeats.record(node_id, epoch=order[0], seq=order[1], at=at)
            return
        async with self.sessions() as session, session.begin():
            node = await read_sync_node(session, node_id)
            if node is None:
                self.forget(node_id)
                raise self._revoked(node_id)
            await record_sync_order(
                session, node_id, epoch=order[0], seq=order[1], at=at, inventory=request.inventory
            )
        memo.order = order

    async def _apply(
        self,
        credential: NodeCredential,
        request: SyncRequest,
        bindings: tuple[ShardBinding, ...],
        at: datetime,
        newer: bool,
    ) -> _Applied:
        for attempt in range(_ATTEMPTS):
            try:
                async with self.sessions() as session, session.begin():
                    return await self._apply_once(session, credential, request, bindings, at, newer)
            except DBAPIError as exc:
                # A deadlock or serialization failure did nothing: the transaction is retried.
                sqlstate = sqlstate_of(exc)
                if sqlstate not in RETRYABLE_SQLSTATES or attempt == _ATTEMPTS - 1:
                    raise
                log.info(
                    "sync_retried", node=str(credential.node_id), sqlstate=sqlstate, attempt=attempt
                )
        raise AssertionError("unreachable")  # pragma: no cover

    async def _apply_once(
        self,
        session: AsyncSession,
        credential: NodeCredential,
        request: SyncRequest,
        bindings: tuple[ShardBinding, ...],
        at: datetime,
        newer: bool,
    ) -> _Applied:
        # The row, fresh: a credential replaced since the cached copy is refused here, before
        # anything is written (raising rolls the transaction back).
        node = await read_sync_node(session, credential.node_id)
        if node is None or not hash_matches(credential.secret, node.credential_hash):
            self.forget(credential.node_id)
            raise self._revoked(credential.node_id)
        version = node.desired_version
        released: list[uuid.UUID] = []
        deferred = False
        foreign = 0
        in_order = newer and await record_sync_order(
            session,
            node.id,
            epoch=request.agent_epoch,
            seq=request.seq,
            at=at,
            inventory=request.inventory,
        )
        if in_order:
            node = replace(node, agent_epoch=request.agent_epoch, agent_seq=request.seq)
        # Pending: its inventory and order are stored; it owns no shards to report on.
        pending = node.approval_state != "approved"
        if in_order and not pending:
            pairs: dict[uuid.UUID, ShardBinding] = {}
            for b in bindings:
                sid = _parse_uuid(b.shard_id)
                if sid is None:
                    foreign += 1
                else:
                    pairs[sid] = b
            written = await apply_bindings(session, node.id, pairs.items())
            foreign += len(pairs) - len(written)
            await apply_observed_adapters(session, node.id, ((s, pairs[s]) for s in written))
            running = [s for s in written if pairs[s].observed_state not in GONE_STATES]
            # Only an agent that has applied the current set has seen these shards desired
            # stopped: one still on an older set may report a crashed engine as `exited`
            # and restart it, and releasing its GPUs then would let them be placed twice.
            if _has_applied(request, version):
                released = await release_stopped_shards(session, node.id, running)
            else:
                deferred = bool(await stopped_shards_gone(session, node.id, running))
            if released:
                version = await bump_desired_version(session, node.id)
                node = replace(node, desired_version=version)
        # The version was read before the shards: the set sent is at least as new as the
        # version it is labelled with, so an agent never holds a version newer than its set.
        if pending or _has_applied(request, version):
            return _Applied(
                node=node,
                in_order=in_order,
                version=version,
                rows=None,
                live_ids=None,
                released=released,
                foreign=foreign,
                release_deferred=deferred,
            )
        rows = await read_desired_shards(session, node.id)
        return _Applied(
            node=node,
            in_order=in_order,
            version=version,
            rows=rows,
            live_ids=frozenset(r.id for r in rows),
            released=released,
            foreign=foreign,
            release_deferred=deferred,
        )


def _knows_all_ids(live_ids: frozenset[uuid.UUID], bindings: tuple[ShardBinding, ...]) -> bool:
    """Every engine the agent reports alive is one of the node's live shards."""
    for b in bindings:
        if b.observed_state in GONE_STATES:
            continue
        sid = _parse_uuid(b.shard_id)
        if sid is None or sid not in live_ids:
            return False
    return True
