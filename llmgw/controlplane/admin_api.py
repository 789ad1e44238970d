"""The admin API under /admin/v1: models, profiles and deployments (create, get, list, update, delete).

Thin routes: parse (pydantic), open one transaction, call ``queries`` and the
profile checks, answer. Every write is audited and wakes the reconciler inside
the same transaction. Authentication is the admin bearer token, compared in
constant time; the routes never see a request without it.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.controlplane import queries
from llmgw.controlplane.profile_checks import LAUNCH_FIELDS, check_profile
from llmgw.controlplane.schemas import (
    AdapterBody,
    DeploymentCreate,
    DeploymentOut,
    DeploymentUpdate,
    ErrorBody,
    ModelCreate,
    ModelOut,
    ModelUpdate,
    ProfileCreate,
    ProfileOut,
    ProfileUpdate,
    check_rollout_budget,
)
from llmgw.controlplane.tables import Deployment, Model, Profile
from llmgw.errors import AuthError, SpecError

__all__ = ["admin_router"]

_bearer = HTTPBearer(auto_error=False)
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 422)
}


def _require_admin(
    request: Request,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    expected: str = request.app.state.admin_token
    if creds is None:
        raise AuthError("missing admin token: send `Authorization: Bearer <admin token>`")
    # Constant time: a byte-by-byte comparison leaks how much of a guess was right.
    if not hmac.compare_digest(creds.credentials.encode(), expected.encode()):
        raise AuthError("wrong admin token; `llmgw up` prints it and writes it to up.json")
    return "admin"


async def _session(request: Request) -> AsyncIterator[AsyncSession]:
    factory: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with factory() as session, session.begin():
        yield session


Actor = Annotated[str, Depends(_require_admin)]
# scope="function": the transaction commits before the response is sent, so a client that
# got 201 can read its write, and a failed commit is an error reply, never a "done".
Session = Annotated[AsyncSession, Depends(_session, scope="function")]

admin_router = APIRouter(
    prefix="/admin/v1", responses=_ERRORS, dependencies=[Depends(_require_admin)]
)


def _rid(request: Request) -> str:
    return str(getattr(request.state, "request_id", ""))


# --- views ------------------------------------------------------------------


def _model_out(m: Model) -> ModelOut:
    return ModelOut.model_validate(m)


def _profile_out(p: Profile, model_name: str) -> ProfileOut:
    return ProfileOut(
        name=p.name,
        model=model_name,
        engine=p.engine,
        gpu_class=p.gpu_class,
        tp=p.tp,
        pp=p.pp,
        gpus_per_node=p.gpus_per_node,
        nodes=p.nodes,
        model_path=p.model_path,
        served_model_name=p.served_model_name,
        args=list(p.args),
        env=dict(p.env),
        secret_env_keys=sorted(p.secret_env),
        adapters=[AdapterBody(**a) for a in p.adapters],
        kv_events=p.kv_events,
        threads=p.threads,
        kv_hash_seed=p.kv_hash_seed,
        kv_block_size=p.kv_block_size,
        kv_hash_algo=p.kv_hash_algo,
        kv_extra_key_format=p.kv_extra_key_format,
        description=p.description,
        fingerprint=p.fingerprint,
        version=p.version,
        created_at=p.created_at,
        updated_at=p.updated_at,
    )


def _deployment_out(d: Deployment, model_name: str, profile_name: str) -> DeploymentOut:
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
        version=d.version,
        created_at=d.created_at,
        updated_at=d.updated_at,
    )


def _audit_view(out: Any) -> dict[str, Any]:
    return dict(out.model_dump(mode="json", exclude={"created_at", "updated_at"}))


# --- models -----------------------------------------------------------------


@admin_router.post("/models", status_code=201, response_model=ModelOut, tags=["models"])
async def create_model(
    body: ModelCreate, request: Request, session: Session, actor: Actor
) -> ModelOut:
    model = Model(name=body.name, description=body.description)
    session.add(model)
    await session.flush()
    await session.refresh(model)
    out = _model_out(model)
    await queries.record_audit(
        session,
        actor=actor,
        action="create",
        kind="model",
        name=body.name,
        before=None,
        after=_audit_view(out),
        request_id=_rid(request),
    )
    return out


@admin_router.get("/models", response_model=list[ModelOut], tags=["models"])
async def list_models(session: Session) -> list[ModelOut]:
    return [_model_out(m) for m in await queries.list_models(session)]


@admin_router.get("/models/{name:path}", response_model=ModelOut, tags=["models"])
async def get_model(name: str, session: Session) -> ModelOut:
    return _model_out(await queries.get_model(session, name))


@admin_router.patch("/models/{name:path}", response_model=ModelOut, tags=["models"])
async def update_model(
    name: str, body: ModelUpdate, request: Request, session: Session, actor: Actor
) -> ModelOut:
    model = await queries.get_model(session, name, lock=True)
    before = _audit_view(_model_out(model))
    changes = body.model_dump(exclude={"version"}, exclude_none=True)
    if queries.apply_changes(model, changes, version=body.version, kind="model"):
        await session.flush()
        await session.refresh(model)
        await queries.record_audit(
            session,
            actor=actor,
            action="update",
            kind="model",
            name=name,
            before=before,
            after=_audit_view(_model_out(model)),
            request_id=_rid(request),
        )
    return _model_out(model)


@admin_router.delete("/models/{name:path}", status_code=204, tags=["models"])
async def delete_model(name: str, request: Request, session: Session, actor: Actor) -> Response:
    model = await queries.delete_model(session, name)
    await queries.record_audit(
        session,
        actor=actor,
        action="delete",
        kind="model",
        name=name,
        before=_audit_view(_model_out(model)),
        after=None,
        request_id=_rid(request),
    )
    return Response(status_code=204)


# --- profiles ---------------------------------------------------------------


@admin_router.post("/profiles", status_code=201, response_model=ProfileOut, tags=["profiles"])
async def create_profile(
    body: ProfileCreate, request: Request, session: Session, actor: Actor
) -> ProfileOut:
    model = await queries.get_model(session, body.model, field="model")
    fields = body.model_dump(exclude={"name", "model"})
    fields["adapters"] = [a.model_dump() for a in body.adapters]
    if fields["kv_hash_seed"] is None:
        fields["kv_hash_seed"] = await queries.cluster_kv_hash_seed(session)
    fields["fingerprint"] = check_profile(body.name, fields)
    profile = Profile(name=body.name, model_id=model.id, **fields)
    session.add(profile)
    await session.flush()
    await session.refresh(profile)
    out = _profile_out(profile, model.name)
    await queries.record_audit(
        session,
        actor=actor,
        action="create",
        kind="profile",
        name=body.name,
        before=None,
        after=_audit_view(out),
        request_id=_rid(request),
    )
    return out


@admin_router.get("/profiles", response_model=list[ProfileOut], tags=["profiles"])
async def list_profiles(session: Session) -> list[ProfileOut]:
    return [_profile_out(p, model) for p, model in await queries.list_profiles(session)]


@admin_router.get("/profiles/{name:path}", response_model=ProfileOut, tags=["profiles"])
async def get_profile(name: str, session: Session) -> ProfileOut:
    profile = await queries.get_profile(session, name)
    model = await session.get(Model, profile.model_id)
    assert model is not None  # FK RESTRICT: a profile's model exists
    return _profile_out(profile, model.name)


@admin_router.patch("/profiles/{name:path}", response_model=ProfileOut, tags=["profiles"])
async def update_profile(
    name: str, body: ProfileUpdate, request: Request, session: Session, actor: Actor
) -> ProfileOut:
    profile = await queries.get_profile(session, name, lock=True)
    model = await session.get(Model, profile.model_id)
    assert model is not None
    before = _audit_view(_profile_out(profile, model.name))
    changes = body.model_dump(exclude={"version"}, exclude_none=True)
    if body.adapters is not None:
        changes["adapters"] = [a.model_dump() for a in body.adapters]
    merged = {f: changes.get(f, getattr(profile, f)) for f in LAUNCH_FIELDS}
    changes["fingerprint"] = check_profile(name, merged)
    if queries.apply_changes(profile, changes, version=body.version, kind="profile"):
        await session.flush()
        await session.refresh(profile)
        await queries.record_audit(
            session,
            actor=actor,
            action="update",
            kind="profile",
            name=name,
            before=before,
            after=_audit_view(_profile_out(profile, model.name)),
            request_id=_rid(request),
        )
    return _profile_out(profile, model.name)


@admin_router.delete("/profiles/{name:path}", status_code=204, tags=["profiles"])
async def delete_profile(name: str, request: Request, session: Session, actor: Actor) -> Response:
    profile = await queries.delete_profile(session, name)
    await queries.record_audit(
        session,
        actor=actor,
        action="delete",
        kind="profile",
        name=name,
        before={"fingerprint": profile.fingerprint},
        after=None,
        request_id=_rid(request),
    )
    return Response(status_code=204)


# --- deployments ------------------------------------------------------------


async def _profile_of_model(session: AsyncSession, profile_name: str, model: Model) -> Profile:
    profile = await queries.get_profile(session, profile_name, field="profile")
    if profile.model_id != model.id:
        raise SpecError(
            f"profile {profile_name!r} belongs to another model, not {model.name!r}; "
            f"pick a profile of {model.name!r} (GET /admin/v1/profiles)",
            field="profile",
        )
    return profile


@admin_router.post(
    "/deployments", status_code=201, response_model=DeploymentOut, tags=["deployments"]
)
async def create_deployment(
    body: DeploymentCreate, request: Request, session: Session, actor: Actor
) -> DeploymentOut:
    model = await queries.get_model(session, body.model, field="model")
    profile = await _profile_of_model(session, body.profile, model)
    deployment = Deployment(
        name=body.name,
        model_id=model.id,
        profile_id=profile.id,
        **body.model_dump(exclude={"name", "model", "profile"}),
    )
    session.add(deployment)
    await session.flush()
    await session.refresh(deployment)
    out = _deployment_out(deployment, model.name, profile.name)
    await queries.record_audit(
        session,
        actor=actor,
        action="create",
        kind="deployment",
        name=body.name,
        before=None,
        after=_audit_view(out),
        request_id=_rid(request),
    )
    return out


async def _names(session: AsyncSession, d: Deployment) -> tuple[str, str]:
    model = await session.get(Model, d.model_id)
    profile = await session.get(Profile, d.profile_id)
    assert model is not None and profile is not None
    return model.name, profile.name


@admin_router.get("/deployments", response_model=list[DeploymentOut], tags=["deployments"])
async def list_deployments(session: Session) -> list[DeploymentOut]:
    return [_deployment_out(d, m, p) for d, m, p in await queries.list_deployments(session)]


@admin_router.get("/deployments/{name:path}", response_model=DeploymentOut, tags=["deployments"])
async def get_deployment(name: str, session: Session) -> DeploymentOut:
    d = await queries.get_deployment(session, name)
    return _deployment_out(d, *await _names(session, d))


@admin_router.patch("/deployments/{name:path}", response_model=DeploymentOut, tags=["deployments"])
async def update_deployment(
    name: str, body: DeploymentUpdate, request: Request, session: Session, actor: Actor
) -> DeploymentOut:
    d = await queries.get_deployment(session, name, lock=True)
    model_name, profile_name = await _names(session, d)
    before = _audit_view(_deployment_out(d, model_name, profile_name))
    changes = body.model_dump(exclude={"version", "profile"}, exclude_none=True)
    if body.profile is not None:
        model = await session.get(Model, d.model_id)
        assert model is not None
        changes["profile_id"] = (await _profile_of_model(session, body.profile, model)).id
    try:
        check_rollout_budget(
            changes.get("max_surge", d.max_surge), changes.get("max_unavailable", d.max_unavailable)
        )
    except ValueError as exc:
        raise SpecError(str(exc), field="max_surge") from None
    if queries.apply_changes(d, changes, version=body.version, kind="deployment"):
        await session.flush()
        await session.refresh(d)
        model_name, profile_name = await _names(session, d)
        await queries.record_audit(
            session,
            actor=actor,
            action="update",
            kind="deployment",
            name=name,
            before=before,
            after=_audit_view(_deployment_out(d, model_name, profile_name)),
            request_id=_rid(request),
        )
    return _deployment_out(d, model_name, profile_name)


@admin_router.delete("/deployments/{name:path}", status_code=204, tags=["deployments"])
async def delete_deployment(
    name: str, request: Request, session: Session, actor: Actor
) -> Response:
    d = await queries.get_deployment(session, name)
    names = await _names(session, d)
    before = _audit_view(_deployment_out(d, *names))
    await queries.delete_deployment(session, name)
    await queries.record_audit(
        session,
        actor=actor,
        action="delete",
        kind="deployment",
        name=name,
        before=before,
        after=None,
        request_id=_rid(request),
    )
    return Response(status_code=204)
