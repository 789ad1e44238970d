"""``GET /admin/v1/usage``: the tokens and requests the gateways accounted, summed.

Rows come from ``usage_buckets`` (per key, model and minute, written by the gateways'
flushes about a second after each request ends), summed per key and model over the whole
range (``group=total``) or per minute, hour or day (UTC). ``key`` is a key's name or id;
``since`` / ``until`` bound the buckets' minutes, ``[since, until)``. At most ``limit`` rows
come back, newest periods first within each key and model; ``truncated`` says more matched.

What this module must NOT do: write, or show anything of a key but its name and id.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from llmgw.controlplane.admin.common import Session
from llmgw.errors import SpecError
from llmgw.store.usage import UsageGroup, usage_sums

__all__ = ["UsageOut", "UsageReply", "router"]

router = APIRouter(tags=["usage"])

_MAX_ROWS = 10_000
_DEFAULT_ROWS = 1000
_BUCKET_S = 60


class UsageOut(BaseModel):
    key: str = Field(description="The key's name.")
    key_id: str
    model: str
    start: datetime = Field(description="The first bucket's minute (the period's start).")
    end: datetime = Field(description="The end of the last bucket's minute (exclusive).")
    requests: int
    prompt_tokens: int
    cached_tokens: int = Field(description="Of the prompt tokens, those served from KV cache.")
    completion_tokens: int
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")


class UsageReply(BaseModel):
    items: list[UsageOut]
    truncated: bool = Field(description="More rows matched than `limit`; narrow the query.")
    next_cursor: str | None = Field(default=None, description="Always null: one page.")


def _utc(value: datetime | None) -> datetime | None:
    # A time without an offset is read as UTC, as the buckets are.
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


@router.get("/usage", response_model=UsageReply)
async def read_usage(
    session: Session,
    key: Annotated[str | None, Query(max_length=256, description="A key's name or id.")] = None,
    model: Annotated[str | None, Query(max_length=256)] = None,
    since: Annotated[datetime | None, Query(description="Buckets from (UTC if no offset).")] = None,
    until: Annotated[datetime | None, Query(description="Buckets before (exclusive).")] = None,
    group: Annotated[
        UsageGroup, Query(description="Sum over the range, or per UTC period.")
    ] = "total",
    limit: Annotated[int, Query(ge=1, le=_MAX_ROWS)] = _DEFAULT_ROWS,
) -> UsageReply:
    since, until = _utc(since), _utc(until)
    if since is not None and until is not None and until <= since:
        raise SpecError(
            f"until ({until.isoformat()}) must be after since ({since.isoformat()})",
            field="until",
        )
    rows = await usage_sums(
        session, group=group, key=key, model=model, since=since, until=until, limit=limit + 1
    )
    items = [
        UsageOut(
            key=row.key_name,
            key_id=row.key_id,
            model=row.model,
            start=row.start,
            end=row.last_bucket + timedelta(seconds=_BUCKET_S),
            requests=row.requests,
            prompt_tokens=row.prompt_tokens,
            cached_tokens=row.cached_tokens,
            completion_tokens=row.completion_tokens,
            total_tokens=row.prompt_tokens + row.completion_tokens,
        )
        for row in rows[:limit]
    ]
    return UsageReply(items=items, truncated=len(rows) > limit)
