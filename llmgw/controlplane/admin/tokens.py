"""``/admin/v1/bootstrap-tokens``: what lets a new node register.

The token (``llmgwb_<id>_<secret>``) is in the reply that creates it and nowhere else:
only SHA-256 of its secret is stored, lists and the audit show the id. DELETE revokes:
the row stays, since nodes name the token they joined with.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.admin.common import AuditOf, Session, add_read_routes, audit_view, page
from llmgw.controlplane.admin.schemas import Page
from llmgw.controlplane.admin.schemas_fleet import (
    BootstrapTokenCreate,
    BootstrapTokenCreated,
    BootstrapTokenOut,
)
from llmgw.store import bootstrap_tokens

__all__ = ["router"]

router = APIRouter(tags=["bootstrap-tokens"])


async def _list(session: AsyncSession, after: str | None, limit: int) -> Page[BootstrapTokenOut]:
    rows = await bootstrap_tokens.list_tokens(session, after=after, limit=limit + 1)
    return page(
        rows, limit, lambda t: t.id, [BootstrapTokenOut.model_validate(t) for t in rows[:limit]]
    )


async def _get(session: AsyncSession, token_id: str) -> BootstrapTokenOut:
    return BootstrapTokenOut.model_validate(await bootstrap_tokens.get_token(session, token_id))


@router.post("/bootstrap-tokens", status_code=201, response_model=BootstrapTokenCreated)
async def create_token(
    body: BootstrapTokenCreate, session: Session, audit: AuditOf
) -> BootstrapTokenCreated:
    """A new token, in this reply only: store it now (it cannot be read again)."""
    row, plaintext = await bootstrap_tokens.create_bootstrap_token(
        session,
        pool=body.pool,
        ttl_s=body.ttl_s,
        uses=body.uses,
        require_approval=body.require_approval,
        description=body.description,
    )
    await session.refresh(row)
    out = BootstrapTokenOut.model_validate(row)
    await audit.record(
        session, action="create", kind="bootstrap-token", name=row.id, before=None,
        after=audit_view(out),
    )  # fmt: skip
    return BootstrapTokenCreated(**out.model_dump(), token=plaintext)


add_read_routes(
    router, plural="bootstrap-tokens", out=BootstrapTokenOut, list_page=_list, get_one=_get,
    key="token_id",
)  # fmt: skip


@router.delete("/bootstrap-tokens/{token_id}", status_code=204)
async def revoke_token(token_id: str, session: Session, audit: AuditOf) -> Response:
    """Revoke: no node can register with it from now on; nodes that joined stay. Revoking
    a revoked token again succeeds and writes nothing."""
    row, was_live = await bootstrap_tokens.revoke_token(session, token_id)
    if was_live:
        await audit.record(
            session, action="revoke", kind="bootstrap-token", name=row.id, before=None,
            after=audit_view(BootstrapTokenOut.model_validate(row)),
        )  # fmt: skip
    return Response(status_code=204)
