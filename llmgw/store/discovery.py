"""The SQL of service discovery: the engines a metrics scraper should find.

One statement: every ready engine (the leader shard, rank 0, of a replica, desired running,
not released, with a proxy URL its agent reported), with the names its labels carry. The
admin route (``admin/discovery.py``) turns these rows into Prometheus' ``http_sd`` groups.

This module must NOT read or return engine keys: the list is served to scrapers.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.store.tables import Deployment, Model, Node, Replica, Shard

__all__ = ["MetricsTarget", "metrics_targets"]


@dataclass(frozen=True, slots=True)
class MetricsTarget:
    shard_id: uuid.UUID
    replica_id: uuid.UUID
    proxy_url: str
    node: str
    # Both "" for a replica whose deployment was deleted.
    deployment: str
    model: str


async def metrics_targets(session: AsyncSession) -> list[MetricsTarget]:
    """The ready engines, in shard id order."""
    rows = await session.execute(
        select(
            Shard.id,
            Shard.replica_id,
            Shard.proxy_url,
            Node.name,
            Deployment.name,
            Model.name,
        )
        .join(Replica, Replica.id == Shard.replica_id)
        .join(Node, Node.id == Shard.node_id)
        # Outer: a deleted deployment's replicas keep serving while they drain.
        .outerjoin(Deployment, Deployment.id == Replica.deployment_id)
        .outerjoin(Model, Model.id == Deployment.model_id)
        .where(
            Shard.rank == 0,
            Shard.observed_state == "ready",
            Shard.desired_state == "running",
            Shard.released.is_(False),
            Shard.proxy_url != "",
        )
        .order_by(Shard.id)
    )
    return [
        MetricsTarget(
            shard_id=shard_id,
            replica_id=replica_id,
            proxy_url=proxy_url,
            node=node,
            deployment=deployment or "",
            model=model or "",
        )
        for shard_id, replica_id, proxy_url, node, deployment, model in rows
    ]
