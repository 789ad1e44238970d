"""``/admin/v1/nodes``: the machines agents registered, and the admins' half of them.

Admins write ``nodes`` (approval, pool, labels, cordon, drain); agents write
``node_status``. Cordon stops new placements; drain also has the reconciler move the
node's shards off (drain implies cordon); uncordon undoes both. A node is deleted only
once it holds no live shard: its engines would otherwise run on with nothing tracking them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.admin.common import (
    Audit,
    AuditOf,
    Session,
    add_read_routes,
    audit_view,
    delete,
    page,
    stored_path_name,
    update,
)
from llmgw.controlplane.admin.schemas import Page
from llmgw.controlplane.admin.schemas_fleet import NodeOut, NodeUpdate
from llmgw.store import fleet as fq
from llmgw.store.tables import Node

__all__ = ["node_out", "router"]

router = APIRouter(tags=["nodes"])


def _placeable(inventory: dict[str, Any]) -> list[tuple[int, str | None]]:
    """(gpu_index, mig_uuid) of each placeable device, keyed as gpu_assignments are: a
    whole GPU by its index; a MIG instance by its parent's index and its own UUID. A GPU
    with MIG enabled is listed by the agent but only its instances are placeable."""
    gpus = inventory.get("gpus") if isinstance(inventory, dict) else None
    by_uuid = {g.get("uuid"): g.get("index") for g in gpus or [] if isinstance(g, dict)}
    out: list[tuple[int, str | None]] = []
    for g in gpus or []:
        if not isinstance(g, dict) or g.get("mig_enabled"):
            continue
        parent = g.get("mig_parent_uuid") or ""
        if parent:
            parent_index = by_uuid.get(parent)
            if isinstance(parent_index, int):
                out.append((parent_index, str(g.get("uuid", ""))))
        elif isinstance(g.get("index"), int):
            out.append((int(g["index"]), None))
    return out


def _view(row: fq.NodeRow) -> NodeOut:
    n, st = row.node, row.status
    inventory = dict(st.inventory) if st is not None else {}
    placeable = _placeable(inventory)
    return NodeOut(
        name=n.name,
        approval_state=n.approval_state,
        pool=n.pool,
        labels=dict(n.labels),
        cordoned=n.cordoned,
        draining=n.draining,
        desired_version=n.desired_version,
        created_at=n.created_at,
        mgmt_addr=st.mgmt_addr if st is not None else "",
        agent_version=st.agent_version if st is not None else "",
        agent_epoch=st.agent_epoch if st is not None else 0,
        last_sync_at=st.last_sync_at if st is not None else None,
        inventory=inventory,
        num_gpus=len(placeable),
        free_gpus=sum(1 for gpu in placeable if gpu not in row.held),
        num_shards=row.num_shards,
    )


def node_out(session: AsyncSession) -> Callable[[Node], Awaitable[NodeOut]]:
    async def view(n: Node) -> NodeOut:
        return _view(await fq.get_node(session, n.name))

    return view


async def _list(session: AsyncSession, after: str | None, limit: int) -> Page[NodeOut]:
    rows = await fq.list_nodes(session, after=after, limit=limit + 1)
    return page(rows, limit, lambda r: r.node.name, [_view(r) for r in rows[:limit]])


async def _get(session: AsyncSession, name: str) -> NodeOut:
    return _view(await fq.get_node(session, stored_path_name("node", name)))


# Nodes named before the name rule (a newline, an escape) stay addressable, percent-encoded.
add_read_routes(
    router, plural="nodes", out=NodeOut, list_page=_list, get_one=_get, convertor="stored"
)


async def _set(
    session: AsyncSession, audit: Audit, name: str, changes: dict[str, Any], action: str
) -> NodeOut:
    node = await fq.lock_node(session, stored_path_name("node", name))
    out, _ = await update(
        session,
        audit,
        kind="node",
        name=node.name,
        row=node,
        changes=changes,
        version=None,
        view=node_out(session),
        action=action,
    )
    return out


@router.patch("/nodes/{name:stored}", response_model=NodeOut)
async def update_node(name: str, body: NodeUpdate, session: Session, audit: AuditOf) -> NodeOut:
    """Set labels (the whole map) and/or pool."""
    return await _set(session, audit, name, body.model_dump(exclude_none=True), "update")


@router.post("/nodes/{name:stored}/cordon", response_model=NodeOut)
async def cordon_node(name: str, session: Session, audit: AuditOf) -> NodeOut:
    """No new shards are placed on the node; what runs there keeps running."""
    return await _set(session, audit, name, {"cordoned": True}, "cordon")


@router.post("/nodes/{name:stored}/uncordon", response_model=NodeOut)
async def uncordon_node(name: str, session: Session, audit: AuditOf) -> NodeOut:
    """Placeable again; a drain in progress stops (shards already moved stay moved)."""
    return await _set(session, audit, name, {"cordoned": False, "draining": False}, "uncordon")


@router.post("/nodes/{name:stored}/drain", response_model=NodeOut)
async def drain_node(name: str, session: Session, audit: AuditOf) -> NodeOut:
    """Cordon the node and have the reconciler replace its replicas elsewhere, within
    each deployment's rollout budget, then stop its shards."""
    return await _set(session, audit, name, {"cordoned": True, "draining": True}, "drain")


@router.post("/nodes/{name:stored}/approve", response_model=NodeOut)
async def approve_node(name: str, session: Session, audit: AuditOf) -> NodeOut:
    """Let a node that registered with an approval-requiring token take shards."""
    return await _set(session, audit, name, {"approval_state": "approved"}, "approve")


@router.delete("/nodes/{name:stored}", status_code=204)
async def delete_node(name: str, session: Session, audit: AuditOf) -> Response:
    before = audit_view(_view(await fq.get_node(session, stored_path_name("node", name))))
    await delete(
        session,
        audit,
        kind="node",
        name=name,
        before=before,
        remove=lambda: fq.delete_node(session, stored_path_name("node", name)),
    )
    return Response(status_code=204)
