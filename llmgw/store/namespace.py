"""The names clients send as `model`, as stored: model names, each profile's served name and
static adapter names, and declared adapters (``kind: adapter``) with their base models
(docs/architecture.md §3: LoRA adapters share the models' namespace). Read under one transaction-scoped lock, so two admin writes that would each
take the same name cannot both pass their check (the gateway would keep one and silently
drop the other).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["NamedProfile", "StoredNames", "lock_namespace", "read_namespace"]

# pg_advisory_xact_lock's key for "a write that adds a name to the namespace": any constant
# no other lock of llmgw uses ("LLMGWNS\0" as an integer).
_NAMESPACE_LOCK = 0x4C4C4D47574E5300


@dataclass(frozen=True, slots=True)
class NamedProfile:
    """What one stored profile puts in the namespace."""

    profile: str
    model: str
    served: str  # the profile's served_model_name, or its model's name when that is empty
    adapters: tuple[str, ...]


async def lock_namespace(session: AsyncSession) -> None:
    """Serialise the transactions that add names, until this one ends. Taken before any row
    lock of the transaction, so it can never close a cycle with one."""
    await session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _NAMESPACE_LOCK})


_READ_PROFILES = text(
    "SELECT p.name AS profile, m.name AS model, "
    "coalesce(nullif(p.served_model_name, ''), m.name) AS served, p.adapters "
    "FROM profiles p JOIN models m ON m.id = p.model_id ORDER BY p.name"
)


@dataclass(frozen=True, slots=True)
class StoredNames:
    """Every name of the namespace as stored."""

    models: set[str]
    profiles: list[NamedProfile]
    adapters: dict[str, str]  # declared adapter -> its base model


async def read_namespace(session: AsyncSession) -> StoredNames:
    """Every model's name, every profile's served name and static adapters, and every
    declared adapter with its base model."""
    models = {str(n) for n in (await session.execute(text("SELECT name FROM models"))).scalars()}
    declared = {
        str(r.name): str(r.model)
        for r in await session.execute(text("SELECT name, model FROM adapters"))
    }
    profiles = []
    for r in await session.execute(_READ_PROFILES):
        raw = r.adapters if isinstance(r.adapters, list) else []
        adapters = tuple(
            str(a["name"]) for a in raw if isinstance(a, dict) and isinstance(a.get("name"), str)
        )
        profiles.append(NamedProfile(str(r.profile), str(r.model), str(r.served), adapters))
    return StoredNames(models, profiles, declared)
