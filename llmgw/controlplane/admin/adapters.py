"""``/admin/v1/adapters``: LoRA adapters declared on their own (``kind: adapter``), a name in
the models' namespace on a base model, with where nodes find it and its replica bounds.

The leader places declared adapters on replicas of their base model and the agents load them
at runtime (issue [lora] "Adapters at runtime"); each read answers with the adapter's
``status`` (``store.runtime_adapters.read_adapter_status``: two statements for a whole page).
A write here changes no fingerprint and rolls nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import APIRouter, Response
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.admin import namespace
from llmgw.controlplane.admin.common import (
    Audit,
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
from llmgw.controlplane.admin.schemas_adapters import (
    AdapterCreate,
    AdapterFailureOut,
    AdapterHolderOut,
    AdapterOut,
    AdapterStatusOut,
    AdapterUpdate,
    replica_bounds_problem,
)
from llmgw.errors import ConflictError, SpecError
from llmgw.store import adapters as store
from llmgw.store import catalog
from llmgw.store.runtime_adapters import AdapterStatusRow, read_adapter_status
from llmgw.store.tables import Adapter

__all__ = ["adapter_fields", "adapter_out", "adapter_view", "router", "write_adapter"]

router = APIRouter(tags=["adapters"])

# The bounds a PATCH may set back to the default by sending null.
_NULLABLE = ("min_replicas", "max_replicas")


async def adapter_out(a: Adapter) -> AdapterOut:
    """The adapter's view without its status (an apply's, whose audit rows leave it out)."""
    return AdapterOut.model_validate(a)


def _status_out(s: AdapterStatusRow) -> AdapterStatusOut:
    return AdapterStatusOut(
        desired_replicas=s.desired_replicas,
        replicas=[AdapterHolderOut(replica=h.replica_id, node=h.node) for h in s.replicas],
        loaded=[AdapterHolderOut(replica=h.replica_id, node=h.node) for h in s.loaded],
        failures=[
            AdapterFailureOut(
                replica=f.replica_id, node=f.node, reason=f.reason, failures=f.failures
            )
            for f in s.failures
        ],
        unplaced=s.unplaced,
    )


def _with_status(a: Adapter, status: AdapterStatusRow | None) -> AdapterOut:
    out = AdapterOut.model_validate(a)
    return out if status is None else out.model_copy(update={"status": _status_out(status)})


def adapter_view(session: AsyncSession) -> Callable[[Adapter], Awaitable[AdapterOut]]:
    """The view function of adapters read in ``session``, with their status."""

    async def view(a: Adapter) -> AdapterOut:
        return _with_status(a, (await read_adapter_status(session, [a.name])).get(a.name))

    return view


def adapter_fields(body: AdapterCreate) -> dict[str, Any]:
    """The stored columns a create document sets, its name and model aside."""
    return body.model_dump(exclude={"name", "model"})


async def write_adapter(
    session: AsyncSession, audit: Audit, body: AdapterCreate, existing: Adapter | None
) -> tuple[Adapter, Literal["created", "configured", "unchanged"]]:
    """An apply document's write (its checks done by apply): create the adapter, or make the
    stored one (locked, of the same model) what the document says, omitted fields defaults."""
    if existing is None:
        row = Adapter(name=body.name, model=body.model, **adapter_fields(body))
        await create(session, audit, kind="adapter", name=body.name, row=row, view=adapter_out)
        return row, "created"
    _, changed = await update(
        session,
        audit,
        kind="adapter",
        name=body.name,
        row=existing,
        changes=adapter_fields(body),
        version=None,
        view=adapter_out,
    )
    return existing, "configured" if changed else "unchanged"


def _refuse_clash(names: namespace.Namespace, name: str) -> None:
    clash = namespace.adapter_clash(name, names.models, names.profiles)
    if clash is not None:
        raise clash.error()


async def _list(session: AsyncSession, after: str | None, limit: int) -> Page[AdapterOut]:
    rows = await store.list_adapters(session, after=after, limit=limit + 1)
    shown = rows[:limit]
    status = await read_adapter_status(session, [a.name for a in shown])
    return page(rows, limit, lambda a: a.name, [_with_status(a, status.get(a.name)) for a in shown])


async def _get(session: AsyncSession, name: str) -> AdapterOut:
    return await adapter_view(session)(await store.get_adapter(session, path_name("adapter", name)))


@router.post("/adapters", status_code=201, response_model=AdapterOut)
async def create_adapter(body: AdapterCreate, session: Session, audit: AuditOf) -> AdapterOut:
    names = await namespace.read(session)  # first: the namespace lock before any row's
    await catalog.get_model(session, body.model, field="model")
    # Checked first so the 409 says what to do; the primary key still refuses a racing twin.
    if body.name in names.adapters:
        raise ConflictError(
            f"adapter {body.name!r} exists already; change it with "
            f"PATCH /admin/v1/adapters/{body.name}",
            field="name",
        )
    _refuse_clash(names, body.name)
    row = Adapter(name=body.name, model=body.model, **adapter_fields(body))
    return await create(
        session, audit, kind="adapter", name=body.name, row=row, view=adapter_view(session)
    )


add_read_routes(router, plural="adapters", out=AdapterOut, list_page=_list, get_one=_get)


@router.patch("/adapters/{name:path}", response_model=AdapterOut)
async def update_adapter(
    name: str, body: AdapterUpdate, session: Session, audit: AuditOf
) -> AdapterOut:
    row = await store.get_adapter(session, path_name("adapter", name), lock=True)
    changes = body.model_dump(exclude={"version"}, exclude_none=True)
    # null is a value here (the default), not "leave as is": only absent leaves it.
    changes.update({f: getattr(body, f) for f in _NULLABLE if f in body.model_fields_set})
    merged = {f: changes.get(f, getattr(row, f)) for f in _NULLABLE}
    problem = replica_bounds_problem(merged["min_replicas"], merged["max_replicas"])
    if problem is not None:
        # Blame the bound this request sets (the other is the stored one).
        field = "max_replicas" if "max_replicas" in changes else "min_replicas"
        raise SpecError(f"adapter {name!r}: {problem}", field=field)
    out, _ = await update(
        session,
        audit,
        kind="adapter",
        name=name,
        row=row,
        changes=changes,
        version=body.version,
        view=adapter_view(session),
    )
    return out


@router.delete("/adapters/{name:path}", status_code=204)
async def delete_adapter(name: str, session: Session, audit: AuditOf) -> Response:
    row = await store.get_adapter(session, path_name("adapter", name))
    await delete(
        session,
        audit,
        kind="adapter",
        name=name,
        before=audit_view(await adapter_out(row)),
        remove=lambda: store.delete_adapter(session, name),
    )
    return Response(status_code=204)
