"""``POST /admin/v1/apply``: many models, profiles and deployments, all or nothing.

Two phases in one transaction. First every document is checked (its schema, the engine's
validation of a profile, that what it refers to exists in the database or in the same
request, that a profile or deployment is not moved to another model) and *every* problem
is collected: one 422 lists them all, so a file is fixed in one round, and nothing is
written. Then each object is created or updated, models before profiles before
deployments, through the same audited writes the per-resource routes use. An object whose
stored fields already equal its document is ``unchanged``: no version bump, no audit row,
no NOTIFY. ``dry_run`` runs both phases and rolls back.

Apply is declarative, like ``kubectl apply`` without a resource version: a document is the
whole desired object (an omitted field takes its default), and the last writer wins.
The one exception is ``kv_hash_seed``: omitted, it keeps the stored profile's seed, since
reseeding would invalidate every KV cache of the profile for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.controlplane.admin.common import Audit, AuditOf, create, update
from llmgw.controlplane.admin.deployments import deployment_out, save_deployment_changes
from llmgw.controlplane.admin.models import model_out
from llmgw.controlplane.admin.profiles import profile_fields, profile_out, save_profile_changes
from llmgw.controlplane.admin.schemas_fleet import (
    ApplyBody,
    ApplyProblem,
    ApplyReply,
    ApplyResult,
)
from llmgw.controlplane.http.errors import printable
from llmgw.controlplane.schemas import DeploymentCreate, ErrorBody, ModelCreate, ProfileCreate
from llmgw.controlplane.store import catalog
from llmgw.controlplane.store.tables import Deployment, Model, Profile
from llmgw.errors import LlmgwError

__all__ = ["router"]

router = APIRouter(tags=["apply"])

Kind = Literal["model", "profile", "deployment"]
_SCHEMAS: dict[str, type[BaseModel]] = {
    "model": ModelCreate,
    "profile": ProfileCreate,
    "deployment": DeploymentCreate,
}
# Dependency order: what a document refers to is written before it.
_ORDER: tuple[Kind, ...] = ("model", "profile", "deployment")
_Outcome = Literal["created", "configured", "unchanged"]


@dataclass
class _Doc:
    index: int
    kind: Kind
    body: Any  # ModelCreate | ProfileCreate | DeploymentCreate
    fields: dict[str, Any] = field(default_factory=dict)  # a profile's checked columns


class _Problems:
    def __init__(self) -> None:
        self.items: list[ApplyProblem] = []
        # What documents declare, those with problems too: a deployment naming a profile
        # whose document has a typo is not also told that the profile does not exist.
        self.declared_models: set[str] = set()
        self.declared_profiles: dict[str, str] = {}

    def add(
        self, index: int, kind: str | None, name: str | None, field_: str | None, message: str
    ) -> None:
        self.items.append(
            ApplyProblem(index=index, kind=kind, name=name, field=field_, message=message)
        )


def _parse(documents: Sequence[dict[str, Any]], problems: _Problems) -> list[_Doc]:
    """Schema checks of every document; the ones that pass, in request order."""
    docs: list[_Doc] = []
    seen: dict[tuple[str, str], int] = {}
    for i, raw in enumerate(documents):
        kind = raw.get("kind")
        name = raw.get("name") if isinstance(raw.get("name"), str) else None
        if kind not in _SCHEMAS:
            problems.add(
                i, None, name, "kind",
                f"kind {kind!r} is not one apply handles; use model, profile or deployment",
            )  # fmt: skip
            continue
        fields = {k: v for k, v in raw.items() if k != "kind"}
        if name is not None and kind == "model":
            problems.declared_models.add(name)
        if name is not None and kind == "profile" and isinstance(raw.get("model"), str):
            problems.declared_profiles[name] = raw["model"]
        try:
            body: Any = _SCHEMAS[kind].model_validate(fields)
        except ValidationError as exc:
            for err in exc.errors():
                loc = ".".join(str(p) for p in err.get("loc", ())) or None
                if err.get("type") == "extra_forbidden":
                    message = f"unknown field {loc!r}; check its spelling against the API's schema"
                else:
                    message = f"{loc or 'document'}: {err.get('msg', 'invalid')}"
                problems.add(i, kind, name, loc, message)
            continue
        key = (kind, body.name)
        if key in seen:
            problems.add(
                i, kind, body.name, "name",
                f"{kind} {body.name!r} is defined twice (documents {seen[key]} and {i}); "
                "keep one",
            )  # fmt: skip
            continue
        seen[key] = i
        docs.append(_Doc(index=i, kind=kind, body=body))
    return docs


@dataclass
class _Stored:
    models: dict[str, Model]
    profiles: dict[str, tuple[Profile, str]]
    deployments: dict[str, tuple[Deployment, str, str]]


async def _read(session: AsyncSession, docs: Sequence[_Doc]) -> _Stored:
    """Every stored object the documents name or refer to, locked in one order (models,
    profiles, deployments; by name): two applies touching the same objects queue, never
    deadlock, and nothing read here changes before the writes."""
    of = {k: [d.body for d in docs if d.kind == k] for k in _ORDER}
    model_names = {b.name for b in of["model"]} | {b.model for b in of["profile"]}
    model_names |= {b.model for b in of["deployment"]}
    profile_names = {b.name for b in of["profile"]} | {b.profile for b in of["deployment"]}
    return _Stored(
        models=await catalog.get_models(session, sorted(model_names)),
        profiles=await catalog.get_profiles_with_models(session, sorted(profile_names)),
        deployments=await catalog.get_deployments(
            session, sorted(b.name for b in of["deployment"])
        ),
    )


async def _check(
    session: AsyncSession, docs: Sequence[_Doc], stored: _Stored, problems: _Problems
) -> None:
    """References, model moves and the engine's validation of each profile."""
    new_models = problems.declared_models
    # profile name -> its model, as it will be once applied.
    profile_model = {name: model for name, (_p, model) in stored.profiles.items()}
    profile_model.update(problems.declared_profiles)

    def model_missing(d: _Doc) -> None:
        if d.body.model not in stored.models and d.body.model not in new_models:
            problems.add(
                d.index, d.kind, d.body.name, "model",
                f"model {d.body.model!r} does not exist and no document of this request "
                "defines it; add a `kind: model` document for it, or fix the name",
            )  # fmt: skip

    for d in docs:
        if d.kind == "profile":
            model_missing(d)
            existing = stored.profiles.get(d.body.name)
            if existing is not None and existing[1] != d.body.model:
                problems.add(
                    d.index, d.kind, d.body.name, "model",
                    f"profile {d.body.name!r} belongs to model {existing[1]!r}; a profile cannot "
                    "move to another model: give the new one another name",
                )  # fmt: skip
            try:
                d.fields = await profile_fields(
                    session, d.body, None if existing is None else existing[0]
                )
            except LlmgwError as exc:
                problems.add(d.index, d.kind, d.body.name, exc.field, exc.message)
        elif d.kind == "deployment":
            model_missing(d)
            owner = profile_model.get(d.body.profile)
            if owner is None:
                problems.add(
                    d.index, d.kind, d.body.name, "profile",
                    f"profile {d.body.profile!r} does not exist and no document of this request "
                    "defines it; add a `kind: profile` document for it, or fix the name",
                )  # fmt: skip
            elif owner != d.body.model:
                problems.add(
                    d.index, d.kind, d.body.name, "profile",
                    f"profile {d.body.profile!r} belongs to model {owner!r}, not "
                    f"{d.body.model!r}; pick a profile of {d.body.model!r}",
                )  # fmt: skip
            existing_dep = stored.deployments.get(d.body.name)
            if existing_dep is not None and existing_dep[1] != d.body.model:
                problems.add(
                    d.index, d.kind, d.body.name, "model",
                    f"deployment {d.body.name!r} serves model {existing_dep[1]!r}; a deployment "
                    "cannot change its model: delete it and create it anew, or use another name",
                )  # fmt: skip


async def _write_model(
    session: AsyncSession, audit: Audit, b: ModelCreate, stored: _Stored
) -> _Outcome:
    model = stored.models.get(b.name)
    if model is None:
        model = Model(name=b.name, description=b.description)
        await create(session, audit, kind="model", name=b.name, row=model, view=model_out)
        stored.models[b.name] = model
        return "created"
    _, changed = await update(
        session, audit, kind="model", name=b.name, row=model,
        changes={"description": b.description}, version=None, view=model_out,
    )  # fmt: skip
    return "configured" if changed else "unchanged"


async def _write_profile(session: AsyncSession, audit: Audit, d: _Doc, stored: _Stored) -> _Outcome:
    b: ProfileCreate = d.body
    existing = stored.profiles.get(b.name)
    if existing is None:
        profile = Profile(name=b.name, model_id=stored.models[b.model].id, **d.fields)
        await create(
            session, audit, kind="profile", name=b.name, row=profile, view=profile_out(b.model)
        )
        stored.profiles[b.name] = (profile, b.model)
        return "created"
    _, changed = await save_profile_changes(
        session, audit, existing[0], b.model, dict(d.fields), None
    )
    return "configured" if changed else "unchanged"


async def _write_deployment(
    session: AsyncSession, audit: Audit, b: DeploymentCreate, stored: _Stored
) -> _Outcome:
    profile_id = stored.profiles[b.profile][0].id
    spec = b.model_dump(exclude={"name", "model", "profile"})
    existing = stored.deployments.get(b.name)
    if existing is None:
        row = Deployment(
            name=b.name, model_id=stored.models[b.model].id, profile_id=profile_id, **spec
        )
        await create(
            session, audit, kind="deployment", name=b.name, row=row,
            view=deployment_out(session),
        )  # fmt: skip
        return "created"
    _, changed = await save_deployment_changes(
        session, audit, existing[0], {**spec, "profile_id": profile_id}, None
    )
    return "configured" if changed else "unchanged"


async def _write(
    session: AsyncSession, audit: Audit, docs: Sequence[_Doc], stored: _Stored
) -> dict[int, _Outcome]:
    """Create or update each object, in dependency order; what happened to each document."""
    outcome: dict[int, _Outcome] = {}
    for kind in _ORDER:
        for d in (d for d in docs if d.kind == kind):
            if kind == "model":
                outcome[d.index] = await _write_model(session, audit, d.body, stored)
            elif kind == "profile":
                outcome[d.index] = await _write_profile(session, audit, d, stored)
            else:
                outcome[d.index] = await _write_deployment(session, audit, d.body, stored)
    return outcome


def _refusal(problems: Sequence[ApplyProblem]) -> Response:
    first = problems[0]
    where = f"document {first.index}" + (
        f" ({first.kind} {first.name!r})" if first.kind and first.name else ""
    )
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    content = {
        "error": {
            "code": "spec-invalid",
            "message": printable(
                f"nothing was applied: {len(problems)} problem(s) in the documents; "
                f"{where}: {first.message}{more}"
            ),
            "field": None,
            "problems": [
                {k: (printable(v) if isinstance(v, str) else v) for k, v in p.model_dump().items()}
                for p in problems
            ],
        }
    }
    return JSONResponse(status_code=422, content=content)


@router.post(
    "/apply",
    response_model=ApplyReply,
    responses={422: {"model": ErrorBody, "description": "error.problems lists every problem."}},
)
async def apply(body: ApplyBody, request: Request, audit: AuditOf) -> Any:
    """Create or update many objects at once, all or nothing; see the module's rules."""
    problems = _Problems()
    docs = _parse(body.documents, problems)
    factory: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with factory() as session:
        await session.begin()
        try:
            stored = await _read(session, docs)
            await _check(session, docs, stored, problems)
            if problems.items:
                await session.rollback()
                return _refusal(sorted(problems.items, key=lambda p: p.index))
            outcome = await _write(session, audit, docs, stored)
            if body.dry_run:
                await session.rollback()
            else:
                await session.commit()
        except BaseException:
            await session.rollback()
            raise
    results = [
        ApplyResult(index=d.index, kind=d.kind, name=d.body.name, result=outcome[d.index])
        for d in sorted(docs, key=lambda d: d.index)
    ]
    return ApplyReply(dry_run=body.dry_run, results=results)
