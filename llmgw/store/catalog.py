"""The catalog's SQL: models, profiles and deployments (a deployment's rollout status read
with it; declared adapters are ``adapters.py``'s), the admin audit log, and the cluster's KV
hash seed; and the names of the NOTIFY channels that wake the reconciler (``CHANGE_CHANNEL``,
sent by ``record_audit``) and the gateways' route caches (``ROUTES_CHANNEL``, sent by
database triggers). The generic row writes ``admin/common.py`` makes for every route, fleet rows' included, are here too:
``insert_row``, ``apply_changes`` (the version check) and ``save_row``.

Functions take a session, flush, never commit. The caller owns the transaction (``async
with session.begin():``), so a request that fails half-way leaves nothing behind, and
NOTIFY (sent inside it) is delivered only if it commits. Rows are locked ``FOR UPDATE``
before an update is decided, so two admins racing on one row are serialised by Postgres and
the loser sees the winner's version: idempotent if it asked for the same thing, 409 if not.
Nothing here formats HTTP; errors are ``llmgw.errors`` types. The fleet (nodes, replicas,
GPU classes) is ``fleet.py``'s, bootstrap tokens ``bootstrap_tokens.py``'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.errors import ConflictError, NotFoundError, clip
from llmgw.store.tables import (
    Adapter,
    ApiKey,
    AuditLog,
    ClusterInfo,
    Deployment,
    DeploymentAutoscale,
    DeploymentStatus,
    GpuClass,
    Model,
    Node,
    Profile,
)

__all__ = [
    "CHANGE_CHANNEL",
    "ROUTES_CHANNEL",
    "apply_changes",
    "bump_generation",
    "bump_generations_of_profile",
    "cluster_kv_hash_seed",
    "cluster_response_id_secret",
    "delete_deployment",
    "delete_model",
    "delete_profile",
    "deployments_of_profile",
    "forget_autoscale",
    "get_deployment",
    "get_deployment_autoscale",
    "get_deployment_status",
    "get_deployments",
    "get_model",
    "get_model_by_id",
    "get_models",
    "get_profile",
    "get_profile_by_id",
    "get_profiles_with_models",
    "insert_row",
    "list_deployments",
    "list_models",
    "list_profiles",
    "one_by_name",
    "record_audit",
    "save_row",
]

# LISTEN channel the reconciler wakes on. A notification is a hint, never the
# source of truth: the periodic tick is what guarantees progress.
CHANGE_CHANNEL = "llmgw_desired_changed"
# Sent by database triggers (migration 0005) on every write that can change a route: a
# shard's observed or desired state, proxy URL, key or release; a replica's state; a declared
# adapter (migration 0012).
ROUTES_CHANNEL = "llmgw_routes_changed"

_Row = TypeVar("_Row", Model, Profile, Adapter, Deployment, Node, GpuClass)
_Named = TypeVar("_Named", Model, Profile, Adapter, Deployment, GpuClass, ApiKey)


async def one_by_name(
    session: AsyncSession,
    cls: type[_Named],
    name: str,
    *,
    missing: str,
    lock: bool = False,
    field: str = "name",
) -> _Named:
    """The row of ``cls`` named ``name`` (``FOR UPDATE`` with ``lock``); if none is,
    NotFoundError(``missing``) blaming ``field``. The one get-by-name of every named table."""
    stmt = select(cls).where(cls.name == name)
    if lock:
        stmt = stmt.with_for_update()
    row = (await session.execute(stmt)).scalar_one_or_none()
    if row is None:
        raise NotFoundError(missing, field=field)
    return row


async def _one_by_name(
    session: AsyncSession,
    cls: type[_Named],
    kind: str,
    name: str,
    *,
    lock: bool = False,
    field: str = "name",
) -> _Named:
    missing = f"{kind} {clip(name)!r} does not exist; list them with GET /admin/v1/{kind}s"
    return await one_by_name(session, cls, name, missing=missing, lock=lock, field=field)


async def get_model(
    session: AsyncSession, name: str, *, lock: bool = False, field: str = "name"
) -> Model:
    """The model named ``name``; ``field`` is what a NotFoundError blames (the referring field)."""
    return await _one_by_name(session, Model, "model", name, lock=lock, field=field)


async def get_profile(
    session: AsyncSession, name: str, *, lock: bool = False, field: str = "name"
) -> Profile:
    """The profile named ``name``; ``field`` is what a NotFoundError blames (the referring field)."""
    return await _one_by_name(session, Profile, "profile", name, lock=lock, field=field)


async def get_deployment(
    session: AsyncSession, name: str, *, lock: bool = False, field: str = "name"
) -> Deployment:
    """The deployment named ``name``; ``field`` is what a NotFoundError blames (the referring field)."""
    return await _one_by_name(session, Deployment, "deployment", name, lock=lock, field=field)


async def get_model_by_id(session: AsyncSession, model_id: Any) -> Model:
    """The model a profile or deployment refers to (its foreign key RESTRICTs deletion)."""
    model = await session.get(Model, model_id)
    assert model is not None  # FK RESTRICT: a referenced model exists
    return model


async def get_profile_by_id(session: AsyncSession, profile_id: Any) -> Profile:
    """The profile a deployment refers to (its foreign key RESTRICTs deletion)."""
    profile = await session.get(Profile, profile_id)
    assert profile is not None  # FK RESTRICT: a referenced profile exists
    return profile


async def get_models(session: AsyncSession, names: Sequence[str]) -> dict[str, Model]:
    """The named models that exist, locked FOR UPDATE in name order (one lock order for
    every writer, so two bulk writers cannot deadlock)."""
    stmt = select(Model).where(Model.name.in_(sorted(names))).order_by(Model.name)
    rows = (await session.execute(stmt.with_for_update())).scalars().all()
    return {m.name: m for m in rows}


async def get_profiles_with_models(
    session: AsyncSession, names: Sequence[str]
) -> dict[str, tuple[Profile, str]]:
    """The named profiles that exist with their model's name, locked as ``get_models``."""
    stmt = (
        select(Profile, Model.name)
        .join(Model, Profile.model_id == Model.id)
        .where(Profile.name.in_(sorted(names)))
        .order_by(Profile.name)
        .with_for_update(of=Profile)
    )
    return {p.name: (p, m) for p, m in (await session.execute(stmt)).all()}


async def get_deployments(
    session: AsyncSession, names: Sequence[str]
) -> dict[str, tuple[Deployment, str, str]]:
    """The named deployments that exist with their model's and profile's names, locked as
    ``get_models``."""
    stmt = (
        select(Deployment, Model.name, Profile.name)
        .join(Model, Deployment.model_id == Model.id)
        .join(Profile, Deployment.profile_id == Profile.id)
        .where(Deployment.name.in_(sorted(names)))
        .order_by(Deployment.name)
        .with_for_update(of=Deployment)
    )
    return {d.name: (d, m, p) for d, m, p in (await session.execute(stmt)).all()}


async def deployments_of_profile(
    session: AsyncSession, profile_id: Any
) -> list[tuple[str, int, str]]:
    """``(name, replicas, state)`` of every deployment using the profile, in name order: the
    replicas a change of its fingerprint rolls."""
    stmt = (
        select(Deployment.name, Deployment.replicas, Deployment.state)
        .where(Deployment.profile_id == profile_id)
        .order_by(Deployment.name)
    )
    return [(n, r, st) for n, r, st in (await session.execute(stmt)).all()]


async def get_deployment_status(
    session: AsyncSession, deployment_id: Any
) -> DeploymentStatus | None:
    """The reconciler's status row of a deployment; None before its first pass over it."""
    return await session.get(DeploymentStatus, deployment_id)


async def get_deployment_autoscale(
    session: AsyncSession, deployment_id: Any
) -> DeploymentAutoscale | None:
    """The leader's last autoscale decision for a deployment; None: none made (yet)."""
    return await session.get(DeploymentAutoscale, deployment_id)


async def forget_autoscale(session: AsyncSession, deployment_id: Any) -> None:
    """Drop the leader's last decision: a policy removed (and maybe given again later) must
    start from the operator's `replicas`, not from a count decided under the old one."""
    await session.execute(
        delete(DeploymentAutoscale).where(DeploymentAutoscale.deployment_id == deployment_id)
    )


def bump_generation(deployment: Deployment) -> None:
    """Mark a change of the deployment's spec; evaluated in SQL by the UPDATE that saves it."""
    deployment.generation = Deployment.generation + 1


async def bump_generations_of_profile(session: AsyncSession, profile_id: Any) -> list[str]:
    """A fingerprint change of a profile is a new spec for every deployment using it: bump
    their generations in the caller's transaction, so the rollout status they show is stale
    (observed_generation < generation) until the reconciler has seen the change. Returns
    their names, for the audit."""
    result = await session.execute(
        update(Deployment)
        .where(Deployment.profile_id == profile_id)
        .values(generation=Deployment.generation + 1)
        .returning(Deployment.name)
        .execution_options(synchronize_session=False)
    )
    return sorted(str(n) for n in result.scalars().all())


async def list_models(
    session: AsyncSession, *, after: str | None = None, limit: int | None = None
) -> Sequence[Model]:
    """Models in name order, those named after ``after`` only, at most ``limit`` of them.

    Keyset pages: a page is the same whatever was created or deleted before it, and
    costs one index range scan however deep the client has paged.
    """
    stmt = select(Model).order_by(Model.name).limit(limit)
    if after is not None:
        stmt = stmt.where(Model.name > after)
    return (await session.execute(stmt)).scalars().all()


async def list_profiles(
    session: AsyncSession, *, after: str | None = None, limit: int | None = None
) -> list[tuple[Profile, str]]:
    """Profiles with their model's name, in one statement (one snapshot: no row can
    appear between reading profiles and reading the names they refer to); pages as
    ``list_models``."""
    stmt = (
        select(Profile, Model.name)
        .join(Model, Profile.model_id == Model.id)
        .order_by(Profile.name)
        .limit(limit)
    )
    if after is not None:
        stmt = stmt.where(Profile.name > after)
    return [(p, m) for p, m in (await session.execute(stmt)).all()]


async def list_deployments(
    session: AsyncSession, *, after: str | None = None, limit: int | None = None
) -> list[tuple[Deployment, str, str, DeploymentStatus | None, DeploymentAutoscale | None]]:
    """Deployments with their model's and profile's names, their rollout status (None
    before the reconciler's first pass) and the autoscaler's last decision, in one
    statement; pages as ``list_models``."""
    stmt = (
        select(Deployment, Model.name, Profile.name, DeploymentStatus, DeploymentAutoscale)
        .join(Model, Deployment.model_id == Model.id)
        .join(Profile, Deployment.profile_id == Profile.id)
        .outerjoin(DeploymentStatus, DeploymentStatus.deployment_id == Deployment.id)
        .outerjoin(DeploymentAutoscale, DeploymentAutoscale.deployment_id == Deployment.id)
        .order_by(Deployment.name)
        .limit(limit)
    )
    if after is not None:
        stmt = stmt.where(Deployment.name > after)
    return [(d, m, p, st, a) for d, m, p, st, a in (await session.execute(stmt)).all()]


async def cluster_kv_hash_seed(session: AsyncSession) -> str:
    seed = (await session.execute(select(ClusterInfo.kv_hash_seed))).scalar_one()
    return str(seed)


async def cluster_response_id_secret(session: AsyncSession) -> bytes:
    """The secret every gateway of the cluster signs Responses ids with."""
    secret = (await session.execute(select(ClusterInfo.response_id_secret))).scalar_one()
    return bytes(secret)


def apply_changes(row: _Row, changes: Mapping[str, Any], *, version: int | None, kind: str) -> bool:
    """Apply ``changes`` to a row locked FOR UPDATE; return whether anything changed.

    Asking for what the row already holds succeeds whatever ``version`` says: a
    client retrying an update whose reply it lost must not get a 409 for its own
    write. A real change against a stale version is refused, naming both versions.
    ``version`` None: an imperative change (scale, cordon) that applies to whatever
    version is current, or a row without versions.
    """
    differs = {k: v for k, v in changes.items() if getattr(row, k) != v}
    if not differs:
        return False
    current = getattr(row, "version", version)
    if version is not None and version != current:
        raise ConflictError(
            f"{kind} {row.name!r} is at version {current}, the update was based on version "
            f"{version}: someone else changed it; GET it again, reapply your change and retry",
            field="version",
        )
    for k, v in differs.items():
        setattr(row, k, v)
    # `version` is the mapper's version_id_col: the UPDATE bumps it and checks the old value.
    if hasattr(row, "updated_at"):
        row.updated_at = func.now()
    return True


async def insert_row(session: AsyncSession, row: object) -> None:
    """Insert a row an admin route built, then read back what the database filled in (ids,
    defaults, timestamps), so the reply shows the row as stored."""
    session.add(row)
    await session.flush()
    await session.refresh(row)


async def save_row(session: AsyncSession, row: object) -> None:
    """Write the changes ``apply_changes`` made to a row (the UPDATE checks and bumps its
    version), then read back what the database filled in."""
    await session.flush()
    await session.refresh(row)


async def _refuse_if_referenced(
    session: AsyncSession, stmt: Any, what: str, by: str, fix: str
) -> None:
    names = (await session.execute(stmt)).scalars().all()
    if names:
        listed = ", ".join(repr(n) for n in names[:10])
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        raise ConflictError(f"{what} is in use by {by} {listed}{more}; {fix}", field="name")


async def delete_model(session: AsyncSession, name: str) -> Model:
    model = await get_model(session, name, lock=True)
    await _refuse_if_referenced(
        session,
        select(Profile.name).where(Profile.model_id == model.id).order_by(Profile.name),
        f"model {name!r}",
        "profile(s)",
        "delete or move those first",
    )
    # The adapters' foreign key refuses it too (RESTRICT); this names them.
    await _refuse_if_referenced(
        session,
        select(Adapter.name).where(Adapter.model == model.name).order_by(Adapter.name),
        f"model {name!r}",
        "adapter(s)",
        "delete those first (DELETE /admin/v1/adapters/NAME)",
    )
    await session.delete(model)
    await session.flush()
    return model


async def delete_profile(session: AsyncSession, name: str) -> Profile:
    profile = await get_profile(session, name, lock=True)
    await _refuse_if_referenced(
        session,
        select(Deployment.name)
        .where(Deployment.profile_id == profile.id)
        .order_by(Deployment.name),
        f"profile {name!r}",
        "deployment(s)",
        "point them at another profile or delete them first",
    )
    await session.delete(profile)
    await session.flush()
    return profile


async def delete_deployment(session: AsyncSession, name: str) -> Deployment:
    deployment = await get_deployment(session, name, lock=True)
    # The database trigger marks the deployment's shards for stop in this same statement.
    await session.delete(deployment)
    await session.flush()
    return deployment


async def record_audit(
    session: AsyncSession,
    *,
    actor: str,
    action: str,
    kind: str,
    name: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    request_id: str,
) -> None:
    """Write one audit row and wake the reconciler, both inside the caller's transaction."""
    session.add(
        AuditLog(
            actor=actor,
            action=action,
            object_kind=kind,
            object_name=name,
            before=before,
            after=after,
            request_id=request_id,
        )
    )
    payload = json.dumps({"kind": kind, "name": name, "action": action})
    await session.execute(
        text("SELECT pg_notify(:channel, :payload)"),
        {"channel": CHANGE_CHANNEL, "payload": payload},
    )
    await session.flush()
