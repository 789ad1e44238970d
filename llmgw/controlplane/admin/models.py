"""``/admin/v1/models``: the names clients put in "model"."""

from __future__ import annotations

from fastapi import APIRouter, Response
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.admin import namespace
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
from llmgw.controlplane.admin.schemas import ModelCreate, ModelOut, ModelUpdate, Page
from llmgw.store import catalog
from llmgw.store.tables import Model

__all__ = ["model_out", "router"]

router = APIRouter(tags=["models"])


async def model_out(m: Model) -> ModelOut:
    return ModelOut.model_validate(m)


async def _list(session: AsyncSession, after: str | None, limit: int) -> Page[ModelOut]:
    rows = await catalog.list_models(session, after=after, limit=limit + 1)
    return page(rows, limit, lambda m: m.name, [await model_out(m) for m in rows[:limit]])


async def _get(session: AsyncSession, name: str) -> ModelOut:
    return await model_out(await catalog.get_model(session, path_name("model", name)))


@router.post("/models", status_code=201, response_model=ModelOut)
async def create_model(body: ModelCreate, session: Session, audit: AuditOf) -> ModelOut:
    names = await namespace.read(session)
    clash = namespace.model_clash(body.name, names.profiles, names.adapters)
    if clash is not None:
        raise clash.error()
    row = Model(name=body.name, description=body.description)
    return await create(session, audit, kind="model", name=body.name, row=row, view=model_out)


add_read_routes(router, plural="models", out=ModelOut, list_page=_list, get_one=_get)


@router.patch("/models/{name:path}", response_model=ModelOut)
async def update_model(name: str, body: ModelUpdate, session: Session, audit: AuditOf) -> ModelOut:
    row = await catalog.get_model(session, path_name("model", name), lock=True)
    changes = body.model_dump(exclude={"version"}, exclude_none=True)
    out, _ = await update(
        session,
        audit,
        kind="model",
        name=name,
        row=row,
        changes=changes,
        version=body.version,
        view=model_out,
    )
    return out


@router.delete("/models/{name:path}", status_code=204)
async def delete_model(name: str, session: Session, audit: AuditOf) -> Response:
    row = await catalog.get_model(session, path_name("model", name))
    await delete(
        session,
        audit,
        kind="model",
        name=name,
        before=audit_view(await model_out(row)),
        remove=lambda: catalog.delete_model(session, name),
    )
    return Response(status_code=204)
