"""``/admin/v1/keys``: the API keys clients of the gateway send.

The key (``llmgw_<id>_<secret>``) is in the reply that creates it and nowhere else: only
SHA-256 of its secret is stored; lists, gets and the audit show its id and name, never the
secret, its hash or its cache salt (which isolates a tenant's KV cache). Revoking (``DELETE``
or ``POST /keys/{name}/revoke``) disables the key and keeps the row, which accounting refers
to. Every change NOTIFYs ``store.keys.KEYS_CHANNEL`` in its transaction, so every gateway's
``KeyCache`` re-reads the keys within a second of the commit.

What this module must NOT do: log or return a secret, its hash or a cache salt.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Response
from pydantic import (
    AwareDatetime,
    Field,
    StrictInt,
    StringConstraints,
    field_validator,
    model_validator,
)
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.controlplane.admin.common import (
    Audit,
    AuditOf,
    Session,
    add_read_routes,
    create,
    page,
    update,
)
from llmgw.controlplane.admin.schemas import LIMITS, Name, Page, _Request, _Response
from llmgw.errors import ConflictError, SpecError
from llmgw.store.credentials import new_api_key
from llmgw.store.keys import get_key, key_name_taken, list_keys, notify_keys_changed
from llmgw.store.tables import KEY_NAME_PATTERN, ApiKey

__all__ = ["ApiKeyCreate", "ApiKeyCreated", "ApiKeyOut", "router"]

router = APIRouter(tags=["keys"])

KeyName = Annotated[str, StringConstraints(pattern=KEY_NAME_PATTERN)]
# Far above any real limit, and inside Postgres' 32-bit integer columns.
_INT32_MAX = 2**31 - 1
_MAX_ALLOWED_MODELS = 1024
# A generated salt: 128 random bits, as much isolation as a salt can give.
_SALT_BYTES = 16
_MAX_SALT_CHARS = LIMITS["short_text_chars"]


class ApiKeyCreate(_Request):
    name: KeyName = Field(description="Unique; letters, digits and ._:@- (no slashes).")
    models: list[Name] | None = Field(
        default=None,
        max_length=_MAX_ALLOWED_MODELS,
        description="The model and adapter names the key may use; null: every model.",
    )
    rpm: StrictInt | None = Field(
        default=None, ge=1, le=_INT32_MAX, description="Requests per minute."
    )
    tpm: StrictInt | None = Field(
        default=None, ge=1, le=_INT32_MAX, description="Tokens (prompt + completion) per minute."
    )
    quota: StrictInt | None = Field(
        default=None,
        ge=0,
        le=2**62,
        description="Tokens (prompt + completion) per period; null: no quota.",
    )
    period: Literal["day", "month"] | None = Field(
        default=None, description="The quota's period (UTC); with a quota and without: month."
    )
    concurrency: StrictInt | None = Field(
        default=None, ge=1, le=_INT32_MAX, description="Requests in flight per gateway."
    )
    priority: StrictInt = Field(
        default=0,
        ge=0,
        le=100,
        description="Weight in the gateway queue's fairness: while keys wait, a key of "
        "priority p is served p + 1 times the tokens of a priority-0 key.",
    )
    expires_at: AwareDatetime | None = Field(default=None, description="Null: never expires.")
    cache_salt: bool | str = Field(
        default=False,
        description="Tenant isolation: true for a random salt, or the salt itself (to share "
        "a cache among keys of one tenant); false: none.",
    )

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _salt_shape(cls, value: object) -> object:
        # One message for both shapes: pydantic's own would list a failure per union member.
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and 1 <= len(value) <= _MAX_SALT_CHARS and value.isprintable():
            return value
        raise ValueError(
            f"must be true (a random salt), false (none) or a salt of 1 to {_MAX_SALT_CHARS} "
            "printable characters"
        )

    @model_validator(mode="after")
    def _period_needs_quota(self) -> ApiKeyCreate:
        if self.period is not None and self.quota is None:
            raise ValueError(
                "period: a period without a quota limits nothing; give quota too, or drop period"
            )
        return self


class ApiKeyOut(_Response):
    name: str
    id: str
    allowed_models: list[str] | None = Field(description="null: every model.")
    rate_limit_rpm: int | None
    rate_limit_tpm: int | None
    token_quota: int | None
    quota_period: str | None
    concurrency_limit: int | None
    priority: int
    cache_salted: bool = Field(description="Whether the key has a cache salt (never shown).")
    expires_at: datetime | None
    disabled: bool = Field(description="Revoked: the gateway refuses it; its usage is kept.")
    last_used_at: datetime | None = Field(
        description="From usage flushes: right to within a minute."
    )
    version: int
    created_at: datetime
    updated_at: datetime


class ApiKeyCreated(ApiKeyOut):
    key: str = Field(description="The key itself. Shown in this reply only; store it now.")


def _out(row: ApiKey) -> ApiKeyOut:
    return ApiKeyOut(
        name=row.name,
        id=row.id,
        allowed_models=row.allowed_models,
        rate_limit_rpm=row.rate_limit_rpm,
        rate_limit_tpm=row.rate_limit_tpm,
        token_quota=row.token_quota,
        quota_period=row.quota_period,
        concurrency_limit=row.concurrency_limit,
        priority=row.priority,
        cache_salted=row.cache_salt is not None,
        expires_at=row.expires_at,
        disabled=row.disabled,
        last_used_at=row.last_used_at,
        version=row.version,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


async def _view(row: ApiKey) -> ApiKeyOut:
    return _out(row)


async def _list(session: AsyncSession, after: str | None, limit: int) -> Page[ApiKeyOut]:
    rows = await list_keys(session, after=after, limit=limit + 1)
    return page(rows, limit, lambda k: k.name, [_out(k) for k in rows[:limit]])


async def _get(session: AsyncSession, name: str) -> ApiKeyOut:
    return _out(await get_key(session, name))


@router.post("/keys", status_code=201, response_model=ApiKeyCreated)
async def create_key(body: ApiKeyCreate, session: Session, audit: AuditOf) -> ApiKeyCreated:
    """A new key, in this reply only: store it now (it cannot be read again)."""
    if body.expires_at is not None and body.expires_at <= datetime.now(UTC):
        raise SpecError(
            f"expires_at {body.expires_at.isoformat()} is in the past: the key could never be "
            "used; give a future time, or none for a key that does not expire",
            field="expires_at",
        )
    # Checked first so the 409 names the field; the unique constraint still refuses a twin.
    if await key_name_taken(session, body.name):
        raise ConflictError(
            f"an API key named {body.name!r} exists already (revoked keys keep their names, "
            "for accounting); choose another name",
            field="name",
        )
    salt: str | None
    if body.cache_salt is True:
        salt = secrets.token_urlsafe(_SALT_BYTES)
    elif body.cache_salt is False:
        salt = None
    else:
        salt = body.cache_salt
    period = body.period or ("month" if body.quota is not None else None)
    key = new_api_key()
    row = ApiKey(
        id=key.id,
        name=body.name,
        secret_sha256=key.secret_sha256,
        allowed_models=None if body.models is None else sorted(set(body.models)),
        rate_limit_rpm=body.rpm,
        rate_limit_tpm=body.tpm,
        token_quota=body.quota,
        quota_period=period,
        concurrency_limit=body.concurrency,
        priority=body.priority,
        cache_salt=salt,
        expires_at=body.expires_at,
    )
    out = await create(session, audit, kind="key", name=body.name, row=row, view=_view)
    await notify_keys_changed(session, key.id)
    return ApiKeyCreated(**out.model_dump(), key=key.plaintext)


add_read_routes(router, plural="keys", out=ApiKeyOut, list_page=_list, get_one=_get)


async def _revoke(session: AsyncSession, audit: Audit, name: str) -> ApiKeyOut:
    row = await get_key(session, name, lock=True)
    out, changed = await update(
        session,
        audit,
        kind="key",
        name=name,
        row=row,
        changes={"disabled": True},
        version=None,
        view=_view,
        action="revoke",
    )
    if changed:
        await notify_keys_changed(session, row.id)
    return out


@router.post("/keys/{name}/revoke", response_model=ApiKeyOut)
async def revoke_key(name: str, session: Session, audit: AuditOf) -> ApiKeyOut:
    """Disable the key: every gateway refuses it within a second. Its usage is kept; revoking
    a revoked key again succeeds and writes nothing."""
    return await _revoke(session, audit, name)


@router.delete("/keys/{name}", status_code=204)
async def delete_key(name: str, session: Session, audit: AuditOf) -> Response:
    """The same as ``POST /keys/{name}/revoke``: the row stays, for accounting."""
    await _revoke(session, audit, name)
    return Response(status_code=204)
