"""``/admin/v1/deployments``: model + profile + pool + replica count + rollout policy.

Every change of a deployment's spec bumps its ``generation``; its ``status`` is the
rollout status the reconciler wrote (``deployment_status``), never written here. Scale,
suspend and resume are imperative (no ``version``): they set what they name, whatever
else changed meanwhile, as ``kubectl scale`` does. Deleting a deployment deletes its row
only: its replicas keep theirs (FK SET NULL) and the reconciler drains and stops them.
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
    create,
    delete,
    page,
    path_name,
    update,
)
from llmgw.controlplane.admin.schemas import Page
from llmgw.controlplane.admin.schemas_deployments import (
    AutoscaleBody,
    AutoscaleStatusOut,
    DeploymentCreate,
    DeploymentOut,
    DeploymentStatusOut,
    DeploymentUpdate,
    ScaleBody,
    check_rollout_budget,
)
from llmgw.errors import SpecError
from llmgw.store import catalog
from llmgw.store.tables import (
    Deployment,
    DeploymentAutoscale,
    DeploymentStatus,
    Model,
    Profile,
)

__all__ = ["deployment_out", "router", "save_deployment_changes"]

router = APIRouter(tags=["deployments"])


def _view(
    d: Deployment,
    model_name: str,
    profile_name: str,
    status: DeploymentStatus | None,
    scale: DeploymentAutoscale | None = None,
) -> DeploymentOut:
    return DeploymentOut(
        name=d.name,
        model=model_name,
        profile=profile_name,
        pool=d.pool,
        replicas=d.replicas,
        max_surge=d.max_surge,
        max_unavailable=d.max_unavailable,
        progress_deadline_s=d.progress_deadline_s,
        state=d.state,
        generation=d.generation,
        status=(
            DeploymentStatusOut() if status is None else DeploymentStatusOut.model_validate(status)
        ),
        autoscale=None if d.autoscale is None else AutoscaleBody.model_validate(d.autoscale),
        autoscale_status=(
            None
            if d.autoscale is None or scale is None
            else AutoscaleStatusOut.model_validate(scale)
        ),
        version=d.version,
        created_at=d.created_at,
        updated_at=d.updated_at,
    )


def deployment_out(session: AsyncSession) -> Callable[[Deployment], Awaitable[DeploymentOut]]:
    """The view function of deployments read in ``session`` (names and status looked up)."""

    async def view(d: Deployment) -> DeploymentOut:
        model = await catalog.get_model_by_id(session, d.model_id)
        profile = await catalog.get_profile_by_id(session, d.profile_id)
        status = await catalog.get_deployment_status(session, d.id)
        scale = await catalog.get_deployment_autoscale(session, d.id)
        return _view(d, model.name, profile.name, status, scale)

    return view


async def _bump(d: Any) -> None:
    catalog.bump_generation(d)


async def save_deployment_changes(
    session: AsyncSession,
    audit: Audit,
    d: Deployment,
    changes: dict[str, Any],
    version: int | None,
    action: str = "update",
) -> tuple[DeploymentOut, bool]:
    """Update a locked deployment; a real change bumps its generation in the same UPDATE.
    Removing its autoscale policy forgets the leader's last decision too."""
    if "autoscale" in changes and changes["autoscale"] is None and d.autoscale is not None:
        await catalog.forget_autoscale(session, d.id)
    return await update(
        session,
        audit,
        kind="deployment",
        name=d.name,
        row=d,
        changes=changes,
        version=version,
        view=deployment_out(session),
        action=action,
        on_change=_bump,
    )


async def profile_of_model(session: AsyncSession, profile_name: str, model: Model) -> Profile:
    profile = await catalog.get_profile(session, profile_name, field="profile")
    if profile.model_id != model.id:
        raise SpecError(
            f"profile {profile_name!r} belongs to another model, not {model.name!r}; "
            f"pick a profile of {model.name!r} (GET /admin/v1/profiles)",
            field="profile",
        )
    return profile


async def _list(session: AsyncSession, after: str | None, limit: int) -> Page[DeploymentOut]:
    rows = await catalog.list_deployments(session, after=after, limit=limit + 1)
    return page(rows, limit, lambda r: r[0].name, [_view(*r) for r in rows[:limit]])


async def _get(session: AsyncSession, name: str) -> DeploymentOut:
    d = await catalog.get_deployment(session, path_name("deployment", name))
    return await deployment_out(session)(d)


@router.post("/deployments", status_code=201, response_model=DeploymentOut)
async def create_deployment(
    body: DeploymentCreate, session: Session, audit: AuditOf
) -> DeploymentOut:
    model = await catalog.get_model(session, body.model, field="model")
    profile = await profile_of_model(session, body.profile, model)
    row = Deployment(
        name=body.name,
        model_id=model.id,
        profile_id=profile.id,
        **body.model_dump(exclude={"name", "model", "profile"}),
    )
    return await create(
        session, audit, kind="deployment", name=body.name, row=row, view=deployment_out(session)
    )


add_read_routes(router, plural="deployments", out=DeploymentOut, list_page=_list, get_one=_get)


async def _locked(session: AsyncSession, name: str) -> Deployment:
    return await catalog.get_deployment(session, path_name("deployment", name), lock=True)


@router.post("/deployments/{name:path}/scale", response_model=DeploymentOut)
async def scale_deployment(
    name: str, body: ScaleBody, session: Session, audit: AuditOf
) -> DeploymentOut:
    """Set the desired replica count; the reconciler adds or drains replicas."""
    d = await _locked(session, name)
    out, _ = await save_deployment_changes(
        session, audit, d, {"replicas": body.replicas}, None, action="scale"
    )
    return out


@router.post("/deployments/{name:path}/suspend", response_model=DeploymentOut)
async def suspend_deployment(name: str, session: Session, audit: AuditOf) -> DeploymentOut:
    """Keep the replicas placed, their engines suspended (or stopped where an engine
    cannot sleep); resume brings them back without a new placement."""
    d = await _locked(session, name)
    out, _ = await save_deployment_changes(
        session, audit, d, {"state": "suspended"}, None, action="suspend"
    )
    return out


@router.post("/deployments/{name:path}/resume", response_model=DeploymentOut)
async def resume_deployment(name: str, session: Session, audit: AuditOf) -> DeploymentOut:
    d = await _locked(session, name)
    out, _ = await save_deployment_changes(
        session, audit, d, {"state": "active"}, None, action="resume"
    )
    return out


@router.patch("/deployments/{name:path}", response_model=DeploymentOut)
async def update_deployment(
    name: str, body: DeploymentUpdate, session: Session, audit: AuditOf
) -> DeploymentOut:
    d = await _locked(session, name)
    changes = body.model_dump(exclude={"version", "profile", "remove_autoscale"}, exclude_none=True)
    if body.remove_autoscale:
        if body.autoscale is not None:
            raise SpecError(
                "autoscale and remove_autoscale together: give one of them", field="autoscale"
            )
        changes["autoscale"] = None
    if body.profile is not None:
        model = await catalog.get_model_by_id(session, d.model_id)
        changes["profile_id"] = (await profile_of_model(session, body.profile, model)).id
    try:
        check_rollout_budget(
            changes.get("max_surge", d.max_surge), changes.get("max_unavailable", d.max_unavailable)
        )
    except ValueError as exc:
        raise SpecError(str(exc), field="max_surge") from None
    out, _ = await save_deployment_changes(session, audit, d, changes, body.version)
    return out


@router.delete("/deployments/{name:path}", status_code=204)
async def delete_deployment(name: str, session: Session, audit: AuditOf) -> Response:
    d = await _locked(session, name)
    before = audit_view(await deployment_out(session)(d))
    await delete(
        session,
        audit,
        kind="deployment",
        name=name,
        before=before,
        remove=lambda: catalog.delete_deployment(session, name),
    )
    return Response(status_code=204)
