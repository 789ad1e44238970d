"""``/admin/v1/actions`` (read-only): what the reconciler did and why, newest first.

The record is bounded (the leader trims it), so this answers "why did my replica
restart?" for recent history, not forever.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from llmgw.controlplane.admin.common import (
    DEFAULT_PAGE,
    Cursor,
    Limit,
    Session,
    decode_cursor,
    page,
)
from llmgw.controlplane.admin.schemas import Page
from llmgw.controlplane.admin.schemas_fleet import ActionOut
from llmgw.errors import SpecError
from llmgw.store import fleet as fq

__all__ = ["router"]

router = APIRouter(tags=["actions"])


@router.get("/actions", response_model=Page[ActionOut])
async def list_actions(
    session: Session,
    deployment: Annotated[
        str | None, Query(max_length=128, description="Only actions on this deployment.")
    ] = None,
    limit: Limit = DEFAULT_PAGE,
    cursor: Cursor = None,
) -> Page[ActionOut]:
    after = decode_cursor(cursor)
    before_id: int | None = None
    if after is not None:
        if not after.isdigit():
            raise SpecError(
                "cursor is not one this endpoint handed out; pass `next_cursor` unchanged",
                field="cursor",
            )
        before_id = int(after)
    rows = await fq.list_actions(
        session, deployment=deployment, before_id=before_id, limit=limit + 1
    )
    return page(
        rows, limit, lambda a: str(a.id), [ActionOut.model_validate(a) for a in rows[:limit]]
    )


router.get("/actions/", response_model=Page[ActionOut], include_in_schema=False)(list_actions)
