"""The SQL of declared adapters (``kind: adapter``, the ``adapters`` table): read one or a page,
lock the ones an apply names, delete one. (A model's adapters refuse its delete in
``catalog.delete_model``.)

Functions take a session, flush, never commit (the caller owns the transaction, as in
``catalog``). The generic writes (insert, the version check, save) are ``catalog``'s, shared
with every other admin table. What this module must NOT do: decide whether a name is free
(``llmgw.controlplane.admin.namespace`` does, over ``namespace``'s locked read) or format HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.errors import clip
from llmgw.store.catalog import one_by_name
from llmgw.store.tables import Adapter

__all__ = [
    "adapter_exists",
    "delete_adapter",
    "get_adapter",
    "get_adapters",
    "list_adapters",
]


async def get_adapter(
    session: AsyncSession, name: str, *, lock: bool = False, field: str = "name"
) -> Adapter:
    """The adapter named ``name`` (``FOR UPDATE`` with ``lock``); NotFoundError blaming
    ``field`` when there is none."""
    missing = f"adapter {clip(name)!r} does not exist; list them with GET /admin/v1/adapters"
    return await one_by_name(session, Adapter, name, missing=missing, lock=lock, field=field)


async def adapter_exists(session: AsyncSession, name: str) -> bool:
    stmt = select(Adapter.name).where(Adapter.name == name)
    return (await session.execute(stmt)).first() is not None


async def get_adapters(session: AsyncSession, names: Sequence[str]) -> dict[str, Adapter]:
    """The named adapters that exist, locked FOR UPDATE in name order (one lock order for
    every writer, as ``catalog.get_models``)."""
    stmt = select(Adapter).where(Adapter.name.in_(sorted(names))).order_by(Adapter.name)
    rows = (await session.execute(stmt.with_for_update())).scalars().all()
    return {a.name: a for a in rows}


async def list_adapters(
    session: AsyncSession, *, after: str | None = None, limit: int | None = None
) -> Sequence[Adapter]:
    """Adapters in name order, after ``after``, at most ``limit``: keyset pages as
    ``catalog.list_models``."""
    stmt = select(Adapter).order_by(Adapter.name).limit(limit)
    if after is not None:
        stmt = stmt.where(Adapter.name > after)
    return (await session.execute(stmt)).scalars().all()


async def delete_adapter(session: AsyncSession, name: str) -> Adapter:
    adapter = await get_adapter(session, name, lock=True)
    await session.delete(adapter)
    await session.flush()
    return adapter
