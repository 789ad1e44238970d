"""``POST /admin/v1/apply``: many models, profiles, adapters and deployments, all or nothing.

Two phases in one transaction. First every document is checked (its schema, the engine's
validation of a profile, that what it refers to exists in the database or in the same
request, that a profile or deployment is not moved to another model) and *every* problem
is collected: one 422 lists them all, so a file is fixed in one round, and nothing is
written. A document that fails its schema still has its references checked (a typo in one
field must not hide a missing model), and an unknown field is answered with the nearest
known one. Then each object is created or updated, models before adapters (``kind:
adapter``, declared on a model) before profiles before deployments, through the same
audited writes the per-resource routes use. An object whose stored fields already equal its
document is ``unchanged``: no version bump, no audit row, no NOTIFY. A ``configured`` one
lists what it changes, field by field (``diff``), and the replicas its new fingerprint rolls. ``dry_run`` runs both phases and rolls back.

Apply is declarative, like ``kubectl apply`` without a resource version: a document is the
whole desired object (an omitted field takes its default), and the last writer wins.
The one exception is ``kv_hash_seed``: omitted, it keeps the stored profile's seed, since
reseeding would invalidate every KV cache of the profile for nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.controlplane.admin import namespace
from llmgw.controlplane.admin.adapters import adapter_fields, write_adapter
from llmgw.controlplane.admin.common import Audit, AuditOf, create, update
from llmgw.controlplane.admin.deployments import deployment_out, save_deployment_changes
from llmgw.controlplane.admin.diff import field_changes
from llmgw.controlplane.admin.models import model_out
from llmgw.controlplane.admin.profiles import (
    named_profile,
    profile_fields,
    profile_out,
    save_profile_changes,
)
from llmgw.controlplane.admin.schemas import ErrorBody, ModelCreate
from llmgw.controlplane.admin.schemas_adapters import AdapterCreate
from llmgw.controlplane.admin.schemas_deployments import DeploymentCreate
from llmgw.controlplane.admin.schemas_fleet import (
    ApplyBody,
    ApplyChange,
    ApplyProblem,
    ApplyReply,
    ApplyResult,
)
from llmgw.controlplane.admin.schemas_profiles import ProfileCreate
from llmgw.errors import LlmgwError
from llmgw.http.errors import printable
from llmgw.store import adapters as adapter_store
from llmgw.store import catalog
from llmgw.store.tables import Adapter, Deployment, Model, Profile

__all__ = ["router"]

router = APIRouter(tags=["apply"])

Kind = Literal["model", "adapter", "profile", "deployment"]
_SCHEMAS: dict[str, type[BaseModel]] = {
    "model": ModelCreate,
    "adapter": AdapterCreate,
    "profile": ProfileCreate,
    "deployment": DeploymentCreate,
}
# Dependency order: what a document refers to is written before it (an adapter after its
# model; nothing refers to an adapter).
_ORDER: tuple[Kind, ...] = ("model", "adapter", "profile", "deployment")
_Outcome = Literal["created", "configured", "unchanged"]
# The fields by which a document names objects: its own name and what it refers to.
_NAMING = ("name", "model", "profile")


@dataclass
class _Doc:
    index: int
    kind: Kind
    # Of the naming fields, those that passed the schema, so a document with a typo
    # elsewhere still has its references checked (and is not written).
    names: dict[str, str]
    # ModelCreate | AdapterCreate | ProfileCreate | DeploymentCreate; None: not to be written
    body: Any
    fields: dict[str, Any] = field(default_factory=dict)  # a profile's checked columns


class _Problems:
    def __init__(self) -> None:
        self.items: list[ApplyProblem] = []
        # What documents declare, those with problems too: a deployment naming a profile
        # whose document has a typo is not also told that the profile does not exist.
        self.declared_models: set[str] = set()
        self.declared_profiles: dict[str, str] = {}
        # Problems that are name clashes (409 when they are all there is).
        self.clashes = 0

    def add(
        self, index: int, kind: str | None, name: str | None, field_: str | None, message: str
    ) -> None:
        self.items.append(
            ApplyProblem(index=index, kind=kind, name=name, field=field_, message=message)
        )


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (itself, or inside list[...] / ... | None), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _unknown_field(schema: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """The message for an unknown field at ``loc``: the nearest known one, or all of them."""
    model: type[BaseModel] | None = schema
    for part in loc[:-1]:
        if model is not None and isinstance(part, str):
            info = model.model_fields.get(part)
            model = None if info is None else _nested_model(info.annotation)
    path = ".".join(str(p) for p in loc)
    known = [] if model is None else list(model.model_fields)
    nearest = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if nearest:
        suggestion = ".".join([*(str(p) for p in loc[:-1]), nearest[0]])
        return f"unknown field `{path}`; did you mean `{suggestion}`?"
    if known:
        return f"unknown field `{path}`; the fields here are: {', '.join(known)}"
    return f"unknown field `{path}`; check its spelling against the API's schema"


def _parse(documents: Sequence[dict[str, Any]], problems: _Problems) -> list[_Doc]:
    """Schema checks of every document; each of a kind apply handles, in request order."""
    docs: list[_Doc] = []
    seen: dict[tuple[str, str], int] = {}
    for i, raw in enumerate(documents):
        kind = raw.get("kind")
        name = raw.get("name") if isinstance(raw.get("name"), str) else None
        if kind not in _SCHEMAS:
            nearest = difflib.get_close_matches(str(kind), _ORDER, n=1)
            hint = f"; did you mean `{nearest[0]}`?" if nearest else ""
            problems.add(
                i, None, name, "kind",
                f"kind {kind!r} is not one apply handles; use model, profile, adapter or "
                f"deployment"
                f"{hint}",
            )  # fmt: skip
            continue
        fields = {k: v for k, v in raw.items() if k != "kind"}
        if name is not None and kind == "model":
            problems.declared_models.add(name)
        if name is not None and kind == "profile" and isinstance(raw.get("model"), str):
            problems.declared_profiles[name] = raw["model"]
        schema = _SCHEMAS[kind]
        bad: set[str] = set()
        body: Any = None
        try:
            body = schema.model_validate(fields)
        except ValidationError as exc:
            for err in exc.errors():
                loc = tuple(err.get("loc", ()))
                where = ".".join(str(p) for p in loc) or None
                if loc:
                    bad.add(str(loc[0]))
                if err.get("type") == "extra_forbidden" and loc:
                    message = _unknown_field(schema, loc)
                else:
                    message = f"{where or 'document'}: {err.get('msg', 'invalid')}"
                problems.add(i, kind, name, where, message)
        names = {
            k: fields[k]
            for k in _NAMING
            if k in schema.model_fields and k not in bad and isinstance(fields.get(k), str)
        }
        if body is not None:
            key = (kind, body.name)
            if key in seen:
                problems.add(
                    i, kind, body.name, "name",
                    f"{kind} {body.name!r} is defined twice (documents {seen[key]} and {i}); "
                    "keep one",
                )  # fmt: skip
                body = None
            else:
                seen[key] = i
        docs.append(_Doc(index=i, kind=kind, names=names, body=body))
    return docs


@dataclass
class _Stored:
    models: dict[str, Model]
    adapters: dict[str, Adapter]
    profiles: dict[str, tuple[Profile, str]]
    deployments: dict[str, tuple[Deployment, str, str]]


async def _read(session: AsyncSession, docs: Sequence[_Doc]) -> _Stored:
    """Every stored object the documents name or refer to, locked in one order (models,
    adapters, profiles, deployments; by name): two applies touching the same objects queue,
    never deadlock, and nothing read here changes before the writes."""

    def named(kind: str, key: str) -> set[str]:
        return {d.names[key] for d in docs if d.kind == kind and key in d.names}

    model_names = (
        named("model", "name")
        | named("adapter", "model")
        | named("profile", "model")
        | named("deployment", "model")
    )
    profile_names = named("profile", "name") | named("deployment", "profile")
    # One statement at a time, in the lock order above.
    models = await catalog.get_models(session, sorted(model_names))
    adapters = await adapter_store.get_adapters(session, sorted(named("adapter", "name")))
    profiles = await catalog.get_profiles_with_models(session, sorted(profile_names))
    deployments = await catalog.get_deployments(session, sorted(named("deployment", "name")))
    return _Stored(models=models, adapters=adapters, profiles=profiles, deployments=deployments)


async def _check(
    session: AsyncSession, docs: Sequence[_Doc], stored: _Stored, problems: _Problems
) -> None:
    """References and model moves of every document, schema-invalid ones included, and the
    engine's validation of each valid profile."""
    new_models = problems.declared_models
    # profile name -> its model, as it will be once applied.
    profile_model = {name: model for name, (_p, model) in stored.profiles.items()}
    profile_model.update(problems.declared_profiles)

    for d in docs:
        name, model = d.names.get("name"), d.names.get("model")
        if (
            d.kind != "model"
            and model is not None
            and model not in stored.models
            and model not in new_models
        ):
            problems.add(
                d.index, d.kind, name, "model",
                f"model {model!r} does not exist and no document of this request "
                "defines it; add a `kind: model` document for it, or fix the name",
            )  # fmt: skip
        if d.kind == "adapter":
            stored_adapter = None if name is None else stored.adapters.get(name)
            if stored_adapter is not None and model is not None and stored_adapter.model != model:
                problems.add(
                    d.index, d.kind, name, "model",
                    f"adapter {name!r} is declared on model {stored_adapter.model!r}; an "
                    "adapter cannot move to another model (it is trained for one): give the "
                    "new one another name",
                )  # fmt: skip
        elif d.kind == "profile":
            existing = None if name is None else stored.profiles.get(name)
            if existing is not None and model is not None and existing[1] != model:
                problems.add(
                    d.index, d.kind, name, "model",
                    f"profile {name!r} belongs to model {existing[1]!r}; a profile cannot "
                    "move to another model: give the new one another name",
                )  # fmt: skip
            if d.body is None:
                continue
            try:
                d.fields = await profile_fields(
                    session, d.body, None if existing is None else existing[0]
                )
            except LlmgwError as exc:
                problems.add(d.index, d.kind, name, exc.field, exc.message)
        elif d.kind == "deployment":
            profile = d.names.get("profile")
            owner = None if profile is None else profile_model.get(profile)
            if profile is not None and owner is None:
                problems.add(
                    d.index, d.kind, name, "profile",
                    f"profile {profile!r} does not exist and no document of this request "
                    "defines it; add a `kind: profile` document for it, or fix the name",
                )  # fmt: skip
            elif owner is not None and model is not None and owner != model:
                problems.add(
                    d.index, d.kind, name, "profile",
                    f"profile {profile!r} belongs to model {owner!r}, not "
                    f"{model!r}; pick a profile of {model!r}",
                )  # fmt: skip
            existing_dep = None if name is None else stored.deployments.get(name)
            if existing_dep is not None and model is not None and existing_dep[1] != model:
                problems.add(
                    d.index, d.kind, name, "model",
                    f"deployment {name!r} serves model {existing_dep[1]!r}; a deployment "
                    "cannot change its model: delete it and create it anew, or use another name",
                )  # fmt: skip


def _check_names(docs: Sequence[_Doc], names: namespace.Namespace, problems: _Problems) -> None:
    """Models, adapters and served names that would clash once applied (``namespace``)."""
    models = [(d.index, d.body.name) for d in docs if d.kind == "model" and d.body is not None]
    adapters = [
        (d.index, d.body.name, d.body.model)
        for d in docs
        if d.kind == "adapter" and d.body is not None
    ]
    profiles = [
        (d.index, named_profile(d.body.name, d.body.model, d.fields["served_model_name"],
                                d.fields["adapters"]))
        for d in docs
        if d.kind == "profile" and d.fields
    ]  # fmt: skip
    kinds = {d.index: d for d in docs}
    for index, clash in namespace.batch_clashes(names, models, profiles, adapters):
        problems.add(index, kinds[index].kind, kinds[index].body.name, clash.field, clash.message)
        problems.clashes += 1


@dataclass
class _Diff:
    changes: list[ApplyChange] = field(default_factory=list)
    rolls: int = 0
    rolled: list[str] = field(default_factory=list)


def _deployment_spec(b: DeploymentCreate) -> dict[str, Any]:
    return b.model_dump(exclude={"name", "model", "profile"})


async def _diffs(session: AsyncSession, docs: Sequence[_Doc], stored: _Stored) -> dict[int, _Diff]:
    """What each document changes in its stored object, and the replicas that rolls; read
    before the writes, which change the rows in place."""
    deployment_docs = {d.body.name: d.body for d in docs if d.kind == "deployment"}
    profile_docs = {d.body.name: d for d in docs if d.kind == "profile"}
    out: dict[int, _Diff] = {}
    for d in docs:
        b = d.body
        if d.kind == "model" and b.name in stored.models:
            model = stored.models[b.name]
            out[d.index] = _Diff(
                field_changes({"description": model.description}, {"description": b.description})
            )
        elif d.kind == "adapter" and b.name in stored.adapters:
            adapter = stored.adapters[b.name]
            wanted = adapter_fields(b)
            out[d.index] = _Diff(field_changes({k: getattr(adapter, k) for k in wanted}, wanted))
        elif d.kind == "profile" and b.name in stored.profiles:
            profile = stored.profiles[b.name][0]
            diff = _Diff(
                field_changes(
                    {k: getattr(profile, k) for k in d.fields}, d.fields, secret=("secret_env",)
                )
            )
            if profile.fingerprint != d.fields["fingerprint"]:
                # Those that switch to another profile in this request roll by their own
                # document's change; those that stay roll by this one.
                for dep, replicas, state in await catalog.deployments_of_profile(
                    session, profile.id
                ):
                    doc = deployment_docs.get(dep)
                    if doc is not None:
                        if doc.profile != b.name:
                            continue
                        replicas, state = doc.replicas, doc.state
                    if state == "active" and replicas > 0:
                        diff.rolls += replicas
                        diff.rolled.append(dep)
            out[d.index] = diff
        elif d.kind == "deployment" and b.name in stored.deployments:
            row, _model, old_profile = stored.deployments[b.name]
            old = {"profile": old_profile, **{k: getattr(row, k) for k in _deployment_spec(b)}}
            diff = _Diff(field_changes(old, {"profile": b.profile, **_deployment_spec(b)}))
            if b.profile != old_profile and b.state == "active" and b.replicas > 0:
                before = (await catalog.get_profile_by_id(session, row.profile_id)).fingerprint
                target = profile_docs.get(b.profile)
                after = (
                    target.fields["fingerprint"]
                    if target is not None
                    else stored.profiles[b.profile][0].fingerprint
                )
                if after != before:
                    diff.rolls, diff.rolled = b.replicas, [b.name]
            out[d.index] = diff
    return out


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
            elif kind == "adapter":
                row, outcome[d.index] = await write_adapter(
                    session, audit, d.body, stored.adapters.get(d.body.name)
                )
                stored.adapters[row.name] = row
            elif kind == "profile":
                outcome[d.index] = await _write_profile(session, audit, d, stored)
            else:
                outcome[d.index] = await _write_deployment(session, audit, d.body, stored)
    return outcome


def _refusal(problems: Sequence[ApplyProblem], clashes_only: bool = False) -> Response:
    first = problems[0]
    where = f"document {first.index}" + (
        f" ({first.kind} {first.name!r})" if first.kind and first.name else ""
    )
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    content = {
        "error": {
            "code": "conflict" if clashes_only else "spec-invalid",
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
    return JSONResponse(status_code=409 if clashes_only else 422, content=content)


@router.post(
    "/apply",
    response_model=ApplyReply,
    responses={
        409: {"model": ErrorBody, "description": "Every problem is a name clash."},
        422: {"model": ErrorBody, "description": "error.problems lists every problem."},
    },
)
async def apply(body: ApplyBody, request: Request, audit: AuditOf) -> Any:
    """Create or update many objects at once, all or nothing; see the module's rules."""
    problems = _Problems()
    docs = _parse(body.documents, problems)
    factory: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with factory() as session:
        await session.begin()
        try:
            names = await namespace.read(session)  # before _read's row locks
            stored = await _read(session, docs)
            await _check(session, docs, stored, problems)
            _check_names(docs, names, problems)
            if problems.items:
                await session.rollback()
                clashes_only = problems.clashes == len(problems.items)
                return _refusal(sorted(problems.items, key=lambda p: p.index), clashes_only)
            # No problem: every document passed its schema, so each has a body to write.
            diffs = await _diffs(session, docs, stored)
            outcome = await _write(session, audit, docs, stored)
            if body.dry_run:
                await session.rollback()
            else:
                await session.commit()
        except BaseException:
            await session.rollback()
            raise
    results = []
    for d in sorted(docs, key=lambda d: d.index):
        diff = diffs.get(d.index, _Diff()) if outcome[d.index] == "configured" else _Diff()
        results.append(
            ApplyResult(
                index=d.index,
                kind=d.kind,
                name=d.body.name,
                result=outcome[d.index],
                changes=diff.changes,
                rolls=diff.rolls,
                rolled_deployments=diff.rolled,
            )
        )
    return ApplyReply(dry_run=body.dry_run, results=results)
