"""The SQL of ``controlplane_instances``: a control plane process's row, its heartbeat, the
list of live ones, and its removal.

Functions take a session and never commit. ``llmgw.controlplane.instances`` runs them on a
timer in its own short transactions and decides what "live" means (seen within a few
heartbeat periods): here that window is a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.protocol.sync import MAX_INSTANCES, ControlPlaneInstance

__all__ = ["InstanceIdentity", "list_live_instances", "remove_instance", "upsert_instance"]


@dataclass(frozen=True, slots=True)
class InstanceIdentity:
    id: str
    # Where agents reach this process's internal listener (its agent API).
    internal_url: str


async def upsert_instance(session: AsyncSession, identity: InstanceIdentity) -> None:
    """Register the instance or mark it seen now: a heartbeat re-creates the row if someone
    (a sweep) deleted it."""
    await session.execute(
        text(
            "INSERT INTO controlplane_instances (id, internal_url) VALUES (:id, :url) "
            "ON CONFLICT (id) DO UPDATE SET internal_url = EXCLUDED.internal_url, "
            "last_seen_at = now()"
        ),
        {"id": identity.id, "url": identity.internal_url},
    )


async def list_live_instances(
    session: AsyncSession, *, within_s: float
) -> tuple[ControlPlaneInstance, ...]:
    """The instances seen within ``within_s``, in id order, at most what a sync carries."""
    result = await session.execute(
        text(
            "SELECT id, internal_url FROM controlplane_instances "
            "WHERE last_seen_at > now() - make_interval(secs => :within) "
            "ORDER BY id LIMIT :limit"
        ),
        {"within": within_s, "limit": MAX_INSTANCES},
    )
    return tuple(ControlPlaneInstance(id=r.id, internal_url=r.internal_url) for r in result)


async def remove_instance(session: AsyncSession, instance_id: str) -> None:
    await session.execute(
        text("DELETE FROM controlplane_instances WHERE id = :id"), {"id": instance_id}
    )
