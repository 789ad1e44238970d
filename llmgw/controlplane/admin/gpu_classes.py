"""``/admin/v1/gpu-classes``: the names profiles give in ``gpu_class``, each a regular
expression over the GPU names agents report (NVML's)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.admin.common import (
    AuditOf,
    Session,
    add_read_routes,
    audit_view,
    create,
    delete,
    page,
    path_name,
    update,
)
from llmgw.controlplane.admin.schemas import Page
from llmgw.controlplane.admin.schemas_fleet import GpuClassCreate, GpuClassOut, GpuClassUpdate
from llmgw.errors import ConflictError
from llmgw.store import fleet as fq
from llmgw.store.tables import GpuClass

__all__ = ["router"]

router = APIRouter(tags=["gpu-classes"])


async def _out(row: Any) -> GpuClassOut:
    return GpuClassOut.model_validate(row)


async def _list(session: AsyncSession, after: str | None, limit: int) -> Page[GpuClassOut]:
    rows = await fq.list_gpu_classes(session, after=after, limit=limit + 1)
    return page(rows, limit, lambda c: c.name, [await _out(c) for c in rows[:limit]])


async def _get(session: AsyncSession, name: str) -> GpuClassOut:
    return await _out(await fq.get_gpu_class(session, path_name("GPU class", name, "gpu-classes")))


@router.post("/gpu-classes", status_code=201, response_model=GpuClassOut)
async def create_gpu_class(body: GpuClassCreate, session: Session, audit: AuditOf) -> GpuClassOut:
    # Checked first so the 409 names the field; the primary key still refuses a racing twin.
    if await fq.gpu_class_exists(session, body.name):
        raise ConflictError(
            f"GPU class {body.name!r} exists already; change it with "
            f"PATCH /admin/v1/gpu-classes/{body.name}",
            field="name",
        )
    row = GpuClass(name=body.name, pattern=body.pattern, description=body.description)
    return await create(session, audit, kind="gpu-class", name=body.name, row=row, view=_out)


add_read_routes(router, plural="gpu-classes", out=GpuClassOut, list_page=_list, get_one=_get)


@router.patch("/gpu-classes/{name:path}", response_model=GpuClassOut)
async def update_gpu_class(
    name: str, body: GpuClassUpdate, session: Session, audit: AuditOf
) -> GpuClassOut:
    row = await fq.get_gpu_class(session, path_name("GPU class", name, "gpu-classes"), lock=True)
    out, _ = await update(
        session,
        audit,
        kind="gpu-class",
        name=name,
        row=row,
        changes=body.model_dump(exclude_none=True),
        version=None,
        view=_out,
    )
    return out


@router.delete("/gpu-classes/{name:path}", status_code=204)
async def delete_gpu_class(name: str, session: Session, audit: AuditOf) -> Response:
    row = await fq.get_gpu_class(session, path_name("GPU class", name, "gpu-classes"))
    await delete(
        session,
        audit,
        kind="gpu-class",
        name=name,
        before=audit_view(await _out(row)),
        remove=lambda: fq.delete_gpu_class(session, name),
    )
    return Response(status_code=204)
