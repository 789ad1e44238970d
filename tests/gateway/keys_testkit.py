"""What the key, limit and accounting tests share: sessions on a test database, keys made as
the admin API makes them, and an async wait. A Postgres that goes away and comes back is
``PgServer.offline`` (tests/pg_harness.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.store.credentials import new_api_key
from llmgw.store.database import create_engine, session_factory
from llmgw.store.keys import notify_keys_changed
from llmgw.store.tables import ApiKey

__all__ = ["insert_key", "revoke_key", "sessions_on"]


@asynccontextmanager
async def sessions_on(db_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(db_url, pool_size=2, connect_timeout_s=2)
    try:
        yield session_factory(engine)
    finally:
        await engine.dispose()


async def insert_key(
    sessions: async_sessionmaker[AsyncSession],
    name: str,
    *,
    models: list[str] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    quota: int | None = None,
    period: str | None = None,
    concurrency: int | None = None,
    cache_salt: str | None = None,
    expires_at: datetime | None = None,
) -> tuple[str, str]:
    """(key id, plaintext key), stored and announced as the admin API does."""
    key = new_api_key()
    async with sessions() as session, session.begin():
        session.add(
            ApiKey(
                id=key.id,
                name=name,
                secret_sha256=key.secret_sha256,
                allowed_models=models,
                rate_limit_rpm=rpm,
                rate_limit_tpm=tpm,
                token_quota=quota,
                quota_period=period or ("month" if quota is not None else None),
                concurrency_limit=concurrency,
                cache_salt=cache_salt,
                expires_at=expires_at,
            )
        )
        await session.flush()
        await notify_keys_changed(session, key.id)
    return key.id, key.plaintext


async def revoke_key(sessions: async_sessionmaker[AsyncSession], name: str) -> None:
    async with sessions() as session, session.begin():
        row = (await session.scalars(select(ApiKey).where(ApiKey.name == name))).one()
        row.disabled = True
        await session.flush()
        await notify_keys_changed(session, row.id)
