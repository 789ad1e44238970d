"""One namespace for the names clients send as `model` (docs/architecture.md §3): model
names, profiles' served names, their static LoRA adapters' names and declared adapters'
(``kind: adapter``). The gateway's route table keys them all in one map, so an adapter named
like a model was stored, then silently dropped by every gateway (hardening-3 finding 14).
Refused here instead, with 409 naming the clash and who holds the name, when a model, a
profile's adapters or served name, or a declared adapter would take a name already taken.

The checks are pure over a snapshot (``Namespace``); ``read`` takes the snapshot under the
namespace lock (``llmgw.store.namespace``), which every route that adds names takes before
any row lock of its transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.errors import ConflictError
from llmgw.store.namespace import NamedProfile, lock_namespace, read_namespace

__all__ = [
    "Clash",
    "NamedProfile",
    "Namespace",
    "adapter_clash",
    "batch_clashes",
    "model_clash",
    "profile_clash",
    "read",
]

_WHY = "models and adapters share one namespace, the names clients send as `model`"


@dataclass(frozen=True, slots=True)
class Clash:
    field: str
    message: str

    def error(self) -> ConflictError:
        return ConflictError(self.message, field=self.field)


@dataclass
class Namespace:
    models: set[str]
    profiles: list[NamedProfile]
    # Declared adapters (``kind: adapter``) -> their base models.
    adapters: dict[str, str] = field(default_factory=dict)

    def without_profile(self, name: str) -> list[NamedProfile]:
        """The other profiles: a profile being rewritten does not clash with its old self."""
        return [p for p in self.profiles if p.profile != name]


async def read(session: AsyncSession) -> Namespace:
    """The namespace as stored, locked until the transaction ends: call it first."""
    await lock_namespace(session)
    stored = await read_namespace(session)
    return Namespace(stored.models, stored.profiles, stored.adapters)


def _declared(name: str, model: str) -> str:
    return f"adapter {name!r} (declared with `kind: adapter` on model {model!r})"


def model_clash(
    name: str, profiles: Iterable[NamedProfile], adapters: Mapping[str, str] | None = None
) -> Clash | None:
    """Why a model may not be called ``name``: an adapter has that name already, a static one
    of a profile or a declared one (``adapters``: name -> base model)."""
    if adapters and name in adapters:
        return Clash(
            "name",
            f"model name {name!r} is taken by {_declared(name, adapters[name])}: {_WHY}; give "
            f"the model another name, or delete the adapter (DELETE /admin/v1/adapters/{name})",
        )
    for p in profiles:
        if name in p.adapters:
            return Clash(
                "name",
                f"model name {name!r} is taken by an adapter of profile {p.profile!r} (model "
                f"{p.model!r}): {_WHY}; give the model another name, or rename the adapter",
            )
    return None


def profile_clash(
    profile: NamedProfile,
    models: Iterable[str],
    others: Iterable[NamedProfile],
    adapters: Mapping[str, str] | None = None,
) -> Clash | None:
    """Why ``profile``'s adapters or served name would clash with a name already taken:
    a model's, another profile's served name, an adapter of another model's profile, a
    declared adapter (``adapters``: name -> base model), or its own served name or adapters
    twice. ``others`` excludes ``profile`` itself."""
    model_names = set(models)
    declared = adapters or {}
    rest = list(others)
    seen: set[str] = set()
    for i, name in enumerate(profile.adapters):
        field = f"adapters.{i}.name"

        def clash(taken_by: str, field: str = field, name: str = name) -> Clash:
            return Clash(
                field,
                f"adapter name {name!r} is taken by {taken_by}: {_WHY}; rename the adapter",
            )

        if name in seen:
            return clash("another adapter of this profile")
        seen.add(name)
        if name in model_names:
            return clash(f"model {name!r}")
        if name in declared:
            return Clash(
                field,
                f"adapter name {name!r} is taken by {_declared(name, declared[name])}: {_WHY}; "
                "rename this profile's adapter, or delete the declared one "
                f"(DELETE /admin/v1/adapters/{name})",
            )
        if name == profile.served:
            return clash("this profile's own served name")
        for q in rest:
            if name == q.served:
                return clash(f"the served name of profile {q.profile!r}")
            if name in q.adapters and q.model != profile.model:
                # The same adapter on two profiles of one model is one route; on two models'
                # profiles it would be two, and the gateway would keep one.
                return clash(f"an adapter of profile {q.profile!r} (model {q.model!r})")
    if profile.served != profile.model:
        if profile.served in declared:
            return Clash(
                "served_model_name",
                f"served name {profile.served!r} is taken by "
                f"{_declared(profile.served, declared[profile.served])}: {_WHY}; serve the "
                "model under another name, or delete the declared adapter",
            )
        for q in rest:
            if profile.served in q.adapters:
                return Clash(
                    "served_model_name",
                    f"served name {profile.served!r} is taken by an adapter of profile "
                    f"{q.profile!r} (model {q.model!r}): {_WHY}; serve the model under "
                    "another name, or rename the adapter",
                )
    return None


def adapter_clash(
    name: str, models: Iterable[str], profiles: Iterable[NamedProfile]
) -> Clash | None:
    """Why a declared adapter may not be called ``name``: a model has that name, or a
    profile serves its model under it, or lists a static adapter by it (whatever the model:
    once declared adapters are routed, the two would be two routes of one name, of which the
    gateway keeps one). Another declared adapter of that name is the same object, not a
    clash."""

    def clash(taken_by: str, fix: str) -> Clash:
        return Clash(
            "name",
            f"adapter name {name!r} is taken by {taken_by}: {_WHY}; give the adapter another "
            f"name, or {fix}",
        )

    if name in set(models):
        return clash(f"model {name!r}", "delete the model")
    for p in profiles:
        if name == p.served:
            return clash(
                f"the served name of profile {p.profile!r} (model {p.model!r})",
                "change that profile's served_model_name",
            )
        if name in p.adapters:
            return clash(
                f"a static adapter of profile {p.profile!r} (model {p.model!r})",
                "remove it from that profile's `adapters`",
            )
    return None


def batch_clashes(
    names: Namespace,
    models: Iterable[tuple[int, str]],
    profiles: Iterable[tuple[int, NamedProfile]],
    adapters: Iterable[tuple[int, str, str]] = (),
) -> list[tuple[int, Clash]]:
    """The clashes of one apply's documents (index, model name), (index, profile) and
    (index, declared adapter's name, its model), against the stored namespace and each other:
    the namespace as it would be once applied."""
    model_docs, profile_docs, adapter_docs = list(models), list(profiles), list(adapters)
    redefined = {p.profile for _, p in profile_docs}
    after = [p for p in names.profiles if p.profile not in redefined]
    after += [p for _, p in profile_docs]
    all_models = names.models | {name for _, name in model_docs}
    all_adapters = names.adapters | {name: model for _, name, model in adapter_docs}
    out: list[tuple[int, Clash]] = []
    for index, name in model_docs:
        clash = model_clash(name, after, all_adapters)
        if clash is not None:
            out.append((index, clash))
    for index, p in profile_docs:
        others = (q for q in after if q.profile != p.profile)
        clash = profile_clash(p, all_models, others, all_adapters)
        if clash is not None:
            out.append((index, clash))
    for index, name, _model in adapter_docs:
        clash = adapter_clash(name, all_models, after)
        if clash is not None:
            out.append((index, clash))
    return out
