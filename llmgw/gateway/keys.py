"""API keys on the gateway's request path: the in-memory cache that checks them.

A key (``llmgw_<id>_<secret>``, llmgw.store.credentials) is found by its id and its
secret checked against the SHA-256 stored for it, in constant time.

``KeyCache`` holds every live key in memory, so authenticating is a dict lookup and one hash,
never a query. It is a ``NotifiedCache`` (``gateway.notified``), refreshed

- at once when the admin API changes a key: every change NOTIFYs ``KEYS_CHANNEL`` inside its
  transaction, which Postgres delivers on commit; the process's LISTEN connection
  (``store.notify``) wakes the refresher, so a revoked key stops working within a second on
  every gateway;
- every ``refresh_interval_s`` (a lost notification, a listener that was reconnecting);
- after the LISTEN connection comes back, since notifications sent while it was down are lost.

A refresh re-reads every live key (level-triggered: a lost, repeated or reordered notification
does no harm). One that fails keeps the keys already loaded and is retried: while Postgres is
down the gateway keeps serving the keys it knew (fail static); a key revoked during the outage
stops working when Postgres returns. Before the first successful load nothing is known, and
``authenticate`` answers 503 (not 401: the key may be fine).

What this module must NOT do: log, store in an exception or put in a repr any key or its hash.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.gateway.errors import GatewayError
from llmgw.gateway.notified import NotifiedCache
from llmgw.logs import get_logger
from llmgw.store.credentials import parse_api_key, secret_sha256
from llmgw.store.keys import KEYS_CHANNEL, live_keys
from llmgw.store.notify import NotifyHub
from llmgw.store.tables import ApiKey

__all__ = ["KeyCache", "KeyContext"]

log = get_logger("llmgw.gateway.keys")

# Compared against when the id is unknown, so an unknown id costs what a known one does.
_NO_HASH = bytes(32)


@dataclass(frozen=True, slots=True)
class KeyContext:
    """What the gateway knows of an authenticated key: who it is and its limits.

    None means "no limit" for every limit; ``quota_period`` is "day" or "month" (UTC) and set
    exactly when ``token_quota`` is.
    """

    key_id: str
    name: str
    # None: every model; otherwise the model and adapter names this key may use.
    allowed_models: frozenset[str] | None
    # Set on every request of this key, so its prompts never share KV blocks with another
    # tenant's (engines hash the salt into the first block).
    cache_salt: str | None
    rpm: int | None
    tpm: int | None
    token_quota: int | None
    quota_period: str | None
    concurrency: int | None
    # The key's weight in the gateway queue (fair_queue): priority + 1.
    priority: int = 0

    def allows(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    def __repr__(self) -> str:  # the salt isolates tenants: keep it out of logs
        return f"KeyContext(key_id={self.key_id!r}, name={self.name!r})"


@dataclass(frozen=True, slots=True)
class _Entry:
    context: KeyContext
    secret_sha256: bytes
    # Epoch seconds; None: never expires.
    expires_at: float | None


def _entry(row: ApiKey) -> _Entry:
    expires: datetime | None = row.expires_at
    return _Entry(
        context=KeyContext(
            key_id=row.id,
            name=row.name,
            allowed_models=None if row.allowed_models is None else frozenset(row.allowed_models),
            cache_salt=row.cache_salt,
            rpm=row.rate_limit_rpm,
            tpm=row.rate_limit_tpm,
            token_quota=row.token_quota,
            quota_period=row.quota_period,
            concurrency=row.concurrency_limit,
            priority=row.priority,
        ),
        secret_sha256=bytes(row.secret_sha256),
        expires_at=None if expires is None else expires.timestamp(),
    )


class KeyCache(NotifiedCache):
    """Every live key, in memory; see the module docstring for how it stays current.

    ``sessions`` reads the keys; ``notify`` is the process's hub (None: only the period).
    ``clock`` is wall-clock seconds, for expiry.
    """

    def __init__(
        self,
        *,
        sessions: async_sessionmaker[AsyncSession],
        notify: NotifyHub | None,
        refresh_interval_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            "keys",
            notify=notify,
            channels=[KEYS_CHANNEL],
            refresh_s=refresh_interval_s,
            log_as="api_keys",
        )
        self._sessions = sessions
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._loaded = False
        # Rises on every successful load; tests and metrics wait on it.
        self.generation = 0
        self.last_loaded_at: float | None = None

    @property
    def loaded(self) -> bool:
        return self._loaded

    @property
    def num_keys(self) -> int:
        return len(self._entries)

    def holds(self) -> int:
        return len(self._entries)

    async def refresh(self) -> None:
        """Re-read every live key and swap the whole map in one step; raises on failure and
        then keeps the old map."""
        async with self._sessions() as session:
            rows = await live_keys(session)
        entries = {row.id: _entry(row) for row in rows}
        removed = len(self._entries.keys() - entries.keys())
        self._entries = entries
        self._loaded = True
        self.generation += 1
        self.last_loaded_at = self._clock()
        log.debug("api_keys_loaded", keys=len(entries), removed=removed)

    def authenticate(self, authorization: str | None) -> KeyContext:
        """The key's context; ``GatewayError.invalid_key()`` for a missing, malformed, unknown,
        wrong, revoked or expired key (one answer for all: which it was is nobody's business)."""
        parts = parse_api_key(authorization)
        if parts is None:
            raise GatewayError.invalid_key()
        if not self._loaded:
            raise GatewayError(
                503,
                "API keys are not loaded yet (the state store is unreachable); retry shortly",
                type_="api_error",
                code="keys_unavailable",
                retry_after_s=1,
            )
        key_id, secret = parts
        entry = self._entries.get(key_id)
        stored = _NO_HASH if entry is None else entry.secret_sha256
        matches = hmac.compare_digest(secret_sha256(secret), stored)
        if entry is None or not matches:
            raise GatewayError.invalid_key()
        if entry.expires_at is not None and self._clock() >= entry.expires_at:
            raise GatewayError.invalid_key()
        return entry.context

    def context(self, key_id: str) -> KeyContext | None:
        """The live key with this id (None: unknown or revoked), without its secret."""
        entry = self._entries.get(key_id)
        return None if entry is None else entry.context
