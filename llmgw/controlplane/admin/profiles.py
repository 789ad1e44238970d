"""``/admin/v1/profiles``: how a model runs on a GPU class.

Every write runs the engine's own validation (``profile_checks``) over the whole merged
profile before anything is stored, and a write that changes the fingerprint bumps the
generation of every deployment using the profile in the same transaction: that is the
change that rolls their replicas, and their rollout status must not look current until
the reconciler has seen it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.admin import namespace
from llmgw.controlplane.admin.common import (
    Audit,
    AuditOf,
    Session,
    add_read_routes,
    create,
    delete,
    page,
    path_name,
    update,
)
from llmgw.controlplane.admin.schemas import Page
from llmgw.controlplane.admin.schemas_profiles import (
    AdapterBody,
    ProfileCreate,
    ProfileOut,
    ProfileUpdate,
)
from llmgw.controlplane.profile_checks import SPEC_FIELDS, check_profile
from llmgw.store import catalog
from llmgw.store.tables import Profile

__all__ = [
    "named_profile",
    "profile_fields",
    "profile_out",
    "router",
    "save_profile_changes",
]

router = APIRouter(tags=["profiles"])

# Every stored field the engine check sees: what a launch spec carries (the tokenizer too: it
# must be one the agent can read, though it changes no fingerprint). multinode_backend changes
# how a multi-node replica is launched; listed here whether or not profile_checks lists it yet.
_CHECKED = tuple(dict.fromkeys((*SPEC_FIELDS, "multinode_backend")))


def _view(p: Profile, model_name: str) -> ProfileOut:
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
        adapter_slots=p.adapter_slots,
        threads=p.threads,
        kv_hash_seed=p.kv_hash_seed,
        kv_block_size=p.kv_block_size,
        kv_hash_algo=p.kv_hash_algo,
        kv_extra_key_format=p.kv_extra_key_format,
        multinode_backend=p.multinode_backend,
        max_in_flight=p.max_in_flight,
        tokenizer=p.tokenizer,
        apis=list(p.apis),
        description=p.description,
        fingerprint=p.fingerprint,
        version=p.version,
        created_at=p.created_at,
        updated_at=p.updated_at,
    )


def profile_out(model_name: str) -> Callable[[Profile], Awaitable[ProfileOut]]:
    """The view function of profiles of the model named ``model_name``."""

    async def view(p: Profile) -> ProfileOut:
        return _view(p, model_name)

    return view


async def profile_fields(
    session: AsyncSession, body: ProfileCreate, existing: Profile | None
) -> dict[str, Any]:
    """The stored columns a create document asks for, checked by the engine, with the
    fingerprint. An unset ``kv_hash_seed`` keeps the stored profile's (re-applying a file
    must not reseed it), else takes the cluster's."""
    fields = body.model_dump(exclude={"name", "model"})
    fields["adapters"] = [a.model_dump() for a in body.adapters]
    if fields["kv_hash_seed"] is None:
        fields["kv_hash_seed"] = (
            existing.kv_hash_seed
            if existing is not None
            else await catalog.cluster_kv_hash_seed(session)
        )
    # The model's name is what the engine answers to when served_model_name is empty.
    fields["fingerprint"] = check_profile(body.name, fields, model=body.model)
    return fields


async def save_profile_changes(
    session: AsyncSession,
    audit: Audit,
    profile: Profile,
    model_name: str,
    changes: dict[str, Any],
    version: int | None,
) -> tuple[ProfileOut, bool]:
    """Update a locked profile; bump its deployments' generations when the fingerprint moves."""
    old_fingerprint = profile.fingerprint
    out, changed = await update(
        session,
        audit,
        kind="profile",
        name=profile.name,
        row=profile,
        changes=changes,
        version=version,
        view=profile_out(model_name),
    )
    if changed and profile.fingerprint != old_fingerprint:
        await catalog.bump_generations_of_profile(session, profile.id)
    return out, changed


def named_profile(
    name: str, model: str, served_model_name: str, adapters: list[dict[str, Any]]
) -> namespace.NamedProfile:
    """What a profile's stored fields put in the names clients send as `model`."""
    return namespace.NamedProfile(
        profile=name,
        model=model,
        served=served_model_name or model,
        adapters=tuple(str(a.get("name", "")) for a in adapters),
    )


def _refuse_clash(
    names: namespace.Namespace,
    name: str,
    model: str,
    served_model_name: str,
    adapters: list[dict[str, Any]],
) -> None:
    clash = namespace.profile_clash(
        named_profile(name, model, served_model_name, adapters),
        names.models,
        names.without_profile(name),
        names.adapters,
    )
    if clash is not None:
        raise clash.error()


async def _list(session: AsyncSession, after: str | None, limit: int) -> Page[ProfileOut]:
    rows = await catalog.list_profiles(session, after=after, limit=limit + 1)
    return page(rows, limit, lambda r: r[0].name, [_view(p, m) for p, m in rows[:limit]])


async def _model_name(session: AsyncSession, profile: Profile) -> str:
    return (await catalog.get_model_by_id(session, profile.model_id)).name


async def _get(session: AsyncSession, name: str) -> ProfileOut:
    profile = await catalog.get_profile(session, path_name("profile", name))
    return _view(profile, await _model_name(session, profile))


@router.post("/profiles", status_code=201, response_model=ProfileOut)
async def create_profile(body: ProfileCreate, session: Session, audit: AuditOf) -> ProfileOut:
    names = await namespace.read(session)
    model = await catalog.get_model(session, body.model, field="model")
    fields = await profile_fields(session, body, None)
    _refuse_clash(names, body.name, model.name, fields["served_model_name"], fields["adapters"])
    row = Profile(name=body.name, model_id=model.id, **fields)
    return await create(
        session, audit, kind="profile", name=body.name, row=row, view=profile_out(model.name)
    )


add_read_routes(router, plural="profiles", out=ProfileOut, list_page=_list, get_one=_get)


@router.patch("/profiles/{name:path}", response_model=ProfileOut)
async def update_profile(
    name: str, body: ProfileUpdate, session: Session, audit: AuditOf
) -> ProfileOut:
    names = await namespace.read(session)  # before the row lock: see namespace.read
    profile = await catalog.get_profile(session, path_name("profile", name), lock=True)
    changes = body.model_dump(exclude={"version"}, exclude_none=True)
    if body.adapters is not None:
        changes["adapters"] = [a.model_dump() for a in body.adapters]
    merged = {f: changes.get(f, getattr(profile, f)) for f in _CHECKED}
    model_name = await _model_name(session, profile)
    changes["fingerprint"] = check_profile(name, merged, model=model_name)
    _refuse_clash(
        names,
        profile.name,
        model_name,
        changes.get("served_model_name", profile.served_model_name),
        changes.get("adapters", profile.adapters),
    )
    out, _ = await save_profile_changes(session, audit, profile, model_name, changes, body.version)
    return out


@router.delete("/profiles/{name:path}", status_code=204)
async def delete_profile(name: str, session: Session, audit: AuditOf) -> Response:
    profile = await catalog.get_profile(session, path_name("profile", name))
    await delete(
        session,
        audit,
        kind="profile",
        name=name,
        before={"fingerprint": profile.fingerprint},
        remove=lambda: catalog.delete_profile(session, name),
    )
    return Response(status_code=204)
