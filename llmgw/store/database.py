"""Connections to the state store: one async engine per process, sessions per request.

The caller owns the transaction (``async with session.begin():``); the store's functions
(one module per subject) flush but never commit, so a rolled-back request leaves nothing
behind and side effects (NOTIFY, cache updates) follow the commit.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

__all__ = ["RETRYABLE_SQLSTATES", "create_engine", "session_factory", "sqlstate_of"]

# Deadlock and serialization failure: Postgres chose this transaction to abort so a concurrent
# one could finish. Nothing was written; the same transaction succeeds when run again.
RETRYABLE_SQLSTATES = frozenset({"40P01", "40001"})


def create_engine(url: str, *, pool_size: int = 10, connect_timeout_s: float = 5.0) -> AsyncEngine:
    return create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        # A connection dropped by a Postgres restart is found before a request uses it.
        pool_pre_ping=True,
        # Statement parameters can hold secrets (a profile's secret_env, a key's hash): they
        # must never reach an exception message or a logged traceback.
        hide_parameters=True,
        connect_args={
            "connect_timeout": max(1, int(connect_timeout_s)),
            "application_name": "llmgw-controlplane",
        },
    )


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    # expire_on_commit=False: rows read in a transaction stay readable after it, for the response.
    return async_sessionmaker(engine, expire_on_commit=False)


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error (SQLAlchemy's wrapper or the driver's own), else None."""
    state: str | None = getattr(getattr(exc, "orig", exc), "sqlstate", None)
    return state
