"""Every SQL statement on ``bootstrap_tokens``: creating one, the admin's list, read and
revoke, the agent API's check and consumption at registration, and ``llmgw up``'s question
whether the token it kept still has a use left.

Functions take a session, flush, and never commit: the caller owns the transaction. A token's
plaintext leaves ``create_bootstrap_token`` once, to be shown once; only SHA-256 of its
secret is stored. Errors are ``llmgw.errors`` types.

This module must not log or return a token's secret after its creation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.errors import NotFoundError, SpecError
from llmgw.store.credentials import new_bootstrap_token, secret_sha256
from llmgw.store.tables import BootstrapToken

__all__ = [
    "TokenGrant",
    "consume_bootstrap_token",
    "create_bootstrap_token",
    "get_token",
    "has_use_left",
    "list_tokens",
    "read_bootstrap_token_hash",
    "revoke_token",
]

# A token that may still register a node: not revoked, not expired, not used up.
_LIVE = "NOT revoked AND expires_at > now() AND (uses_left IS NULL OR uses_left > 0)"


async def create_bootstrap_token(
    session: AsyncSession,
    *,
    pool: str = "default",
    ttl_s: float,
    uses: int | None,
    require_approval: bool = False,
    description: str = "",
) -> tuple[BootstrapToken, str]:
    """A new bootstrap token row and its plaintext (shown once; only its hash is stored).

    ``uses`` None: any number of nodes until it expires.
    """
    if ttl_s <= 0:
        raise SpecError(
            f"bootstrap token ttl_s {ttl_s} must be positive: a token that never expires is a "
            "standing invitation to join the cluster; give it the hours the rollout needs",
            field="ttl_s",
        )
    if uses is not None and uses < 1:
        raise SpecError(
            f"bootstrap token uses {uses} must be at least 1 (or unset for no limit)",
            field="uses",
        )
    token = new_bootstrap_token()
    row = BootstrapToken(
        id=token.id,
        secret_sha256=secret_sha256(token.secret),
        description=description,
        pool=pool,
        require_approval=require_approval,
        expires_at=datetime.now(UTC) + timedelta(seconds=ttl_s),
        uses_left=uses,
    )
    session.add(row)
    await session.flush()
    return row, token.plaintext


# --- the admin API -----------------------------------------------------------------------


async def list_tokens(
    session: AsyncSession, *, after: str | None, limit: int
) -> Sequence[BootstrapToken]:
    stmt = select(BootstrapToken).order_by(BootstrapToken.id).limit(limit)
    if after is not None:
        stmt = stmt.where(BootstrapToken.id > after)
    return (await session.execute(stmt)).scalars().all()


async def get_token(session: AsyncSession, token_id: str, *, lock: bool = False) -> BootstrapToken:
    stmt = select(BootstrapToken).where(BootstrapToken.id == token_id)
    if lock:
        stmt = stmt.with_for_update()
    row = (await session.execute(stmt)).scalar_one_or_none()
    if row is None:
        raise NotFoundError(
            f"bootstrap token {token_id!r} does not exist; list them with "
            "GET /admin/v1/bootstrap-tokens (the id is the part after 'llmgwb_')",
            field="id",
        )
    return row


async def revoke_token(session: AsyncSession, token_id: str) -> tuple[BootstrapToken, bool]:
    """Mark a token revoked (the row stays: nodes name the token they joined with).
    Returns the row and whether it was live before."""
    row = await get_token(session, token_id, lock=True)
    if row.revoked:
        return row, False
    await session.execute(
        update(BootstrapToken).where(BootstrapToken.id == token_id).values(revoked=True)
    )
    await session.flush()
    await session.refresh(row)
    return row, True


# --- registration ------------------------------------------------------------------------


async def read_bootstrap_token_hash(session: AsyncSession, token_id: str) -> bytes | None:
    """The stored hash of the token's secret (None: no such token)."""
    result = await session.execute(
        text("SELECT secret_sha256 FROM bootstrap_tokens WHERE id = :id"), {"id": token_id}
    )
    value = result.scalar_one_or_none()
    return None if value is None else bytes(value)


@dataclass(frozen=True, slots=True)
class TokenGrant:
    """What a consumed bootstrap token gives the node."""

    token_id: str
    pool: str
    require_approval: bool


async def consume_bootstrap_token(session: AsyncSession, token_id: str) -> TokenGrant | None:
    """Take one use of a live token, atomically; None when it is revoked, expired or used up.

    One conditional UPDATE: two registrations racing for a token's last use cannot both
    get it (the second waits on the row lock, then its WHERE no longer matches).
    """
    result = await session.execute(
        text(
            f"UPDATE bootstrap_tokens SET uses_left = uses_left - 1 WHERE id = :id AND {_LIVE} "
            "RETURNING pool, require_approval"
        ),
        {"id": token_id},
    )
    row = result.one_or_none()
    if row is None:
        return None
    return TokenGrant(token_id=token_id, pool=row.pool, require_approval=bool(row.require_approval))


async def has_use_left(session: AsyncSession, token_id: str) -> bool:
    """Whether the token could still register a node (exists, not revoked, expired or used
    up): ``llmgw up`` keeps its agent's token while it is."""
    result = await session.execute(
        text(f"SELECT 1 FROM bootstrap_tokens WHERE id = :id AND {_LIVE}"), {"id": token_id}
    )
    return result.scalar_one_or_none() is not None
