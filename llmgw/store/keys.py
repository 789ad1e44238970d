"""All SQL of API keys: the rows the admin API writes and every gateway's ``KeyCache`` reads,
and the NOTIFY that tells the gateways a key changed.

Functions take a session and never commit: the caller owns the transaction, so a NOTIFY sent
in it is delivered on commit and not at all on rollback.

What this module must NOT do: put a key's secret, its hash or its cache salt into a message.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.store.catalog import one_by_name
from llmgw.store.tables import ApiKey

__all__ = [
    "KEYS_CHANNEL",
    "get_key",
    "key_name_taken",
    "list_keys",
    "live_keys",
    "notify_keys_changed",
]

# The admin API NOTIFYs this channel (payload: the key's id) on every change to a key.
KEYS_CHANNEL = "llmgw_api_keys_changed"


async def notify_keys_changed(session: AsyncSession, key_id: str) -> None:
    """Wake every gateway's KeyCache once this transaction commits (Postgres delivers a
    NOTIFY on commit, and not at all on rollback)."""
    await session.execute(
        text("SELECT pg_notify(:channel, :payload)"), {"channel": KEYS_CHANNEL, "payload": key_id}
    )


async def live_keys(session: AsyncSession) -> Sequence[ApiKey]:
    """Every key not revoked (expired ones included: the gateway checks expiry per request)."""
    return (await session.scalars(select(ApiKey).where(ApiKey.disabled.is_(False)))).all()


async def get_key(session: AsyncSession, name: str, *, lock: bool = False) -> ApiKey:
    """The key named ``name`` (``FOR UPDATE`` with ``lock``); NotFoundError if none is."""
    missing = f"no API key is named {name!r}; list them with GET /admin/v1/keys (`llmgw keys list`)"
    return await one_by_name(session, ApiKey, name, missing=missing, lock=lock)


async def key_name_taken(session: AsyncSession, name: str) -> bool:
    """Whether a key, live or revoked, is named ``name``."""
    return await session.scalar(select(ApiKey.id).where(ApiKey.name == name)) is not None


async def list_keys(session: AsyncSession, *, after: str | None, limit: int) -> Sequence[ApiKey]:
    """Up to ``limit`` keys by name, those after ``after`` (a keyset page)."""
    stmt = select(ApiKey).order_by(ApiKey.name).limit(limit)
    if after is not None:
        stmt = stmt.where(ApiKey.name > after)
    return (await session.scalars(stmt)).all()
