"""All SQL of usage accounting: the gateways' idempotent flushes into ``usage_buckets``, the
quota totals they read back, and the sums ``GET /admin/v1/usage`` shows.

Functions take a session and never commit: the caller owns the transaction, and a flush
counts only if it commits (``gateway.accounting`` says why a retried flush counts once).

What this module must NOT do: read or return anything of a key but its id and name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import Select, func, or_, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from llmgw.store.tables import ApiKey, UsageBucket

__all__ = [
    "UsageGroup",
    "UsageRow",
    "UsageSum",
    "apply_flush",
    "quota_totals",
    "usage_sums",
]


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One bucket's increments, as a flush adds them."""

    api_key_id: str
    model: str
    minute_s: int  # epoch seconds, a multiple of 60
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


_CLAIM = text(
    "INSERT INTO usage_flushes (process_id, flush_seq) VALUES (:process_id, :seq) "
    "ON CONFLICT DO NOTHING RETURNING flush_seq"
)
_FORGET_OLDER = text(
    "DELETE FROM usage_flushes WHERE process_id = :process_id AND flush_seq < :seq"
)
# Rows are sorted by the conflict key, so gateways flushing the same buckets lock them in one
# order and never deadlock. Rows for keys that do not exist are skipped (joined away) rather
# than failing the whole flush forever on the foreign key.
_ADD = text(
    """
    INSERT INTO usage_buckets AS b
        (api_key_id, model, bucket_start, requests, prompt_tokens, completion_tokens,
         cached_tokens)
    SELECT u.api_key_id, u.model, u.bucket_start, u.requests, u.prompt_tokens,
           u.completion_tokens, u.cached_tokens
    FROM unnest(CAST(:keys AS text[]), CAST(:models AS text[]),
                CAST(:starts AS timestamptz[]), CAST(:requests AS bigint[]),
                CAST(:prompt AS bigint[]), CAST(:completion AS bigint[]),
                CAST(:cached AS bigint[]))
         AS u(api_key_id, model, bucket_start, requests, prompt_tokens, completion_tokens,
              cached_tokens)
    JOIN api_keys k ON k.id = u.api_key_id
    ORDER BY u.api_key_id, u.model, u.bucket_start
    ON CONFLICT (api_key_id, model, bucket_start) DO UPDATE SET
        requests = b.requests + EXCLUDED.requests,
        prompt_tokens = b.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = b.completion_tokens + EXCLUDED.completion_tokens,
        cached_tokens = b.cached_tokens + EXCLUDED.cached_tokens
    """
)
_TOUCH_KEYS = text(
    """
    UPDATE api_keys AS k SET last_used_at = greatest(k.last_used_at, u.at)
    FROM unnest(CAST(:ids AS text[]), CAST(:ats AS timestamptz[])) AS u(id, at)
    WHERE k.id = u.id
    """
)


def _ts(epoch_s: float) -> datetime:
    return datetime.fromtimestamp(epoch_s, UTC)


async def apply_flush(
    session: AsyncSession,
    *,
    process_id: str,
    seq: int,
    rows: Iterable[UsageRow],
    last_used: Mapping[str, float] | None = None,
) -> bool:
    """Add ``rows`` to the buckets unless flush ``seq`` of ``process_id`` was applied before;
    ``last_used`` (key id -> epoch seconds) moves keys' ``last_used_at`` forward.

    True: applied now; False: already applied (a retry after a lost commit reply). Runs in
    the caller's transaction, which must commit for either to count.
    """
    claimed = (await session.execute(_CLAIM, {"process_id": process_id, "seq": seq})).first()
    if claimed is None:
        return False
    await session.execute(_FORGET_OLDER, {"process_id": process_id, "seq": seq})
    ordered = sorted(rows, key=lambda r: (r.api_key_id, r.model, r.minute_s))
    if ordered:
        await session.execute(
            _ADD,
            {
                "keys": [r.api_key_id for r in ordered],
                "models": [r.model for r in ordered],
                "starts": [_ts(r.minute_s) for r in ordered],
                "requests": [r.requests for r in ordered],
                "prompt": [r.prompt_tokens for r in ordered],
                "completion": [r.completion_tokens for r in ordered],
                "cached": [r.cached_tokens for r in ordered],
            },
        )
    if last_used:
        ids = sorted(last_used)  # one lock order for every gateway
        await session.execute(_TOUCH_KEYS, {"ids": ids, "ats": [_ts(last_used[i]) for i in ids]})
    return True


_QUOTA_TOTALS = text(
    """
    SELECT b.api_key_id,
           coalesce(sum(b.prompt_tokens + b.completion_tokens), 0) AS month_tokens,
           coalesce(sum(b.prompt_tokens + b.completion_tokens)
                    FILTER (WHERE b.bucket_start >= :day_start), 0) AS day_tokens
    FROM usage_buckets b JOIN api_keys k ON k.id = b.api_key_id
    WHERE k.token_quota IS NOT NULL AND b.bucket_start >= :month_start
    GROUP BY b.api_key_id
    """
)


async def quota_totals(
    session: AsyncSession, *, day_start: float, month_start: float
) -> list[tuple[str, int, int]]:
    """(key id, tokens since ``month_start``, tokens since ``day_start``) of every key with a
    quota and usage since ``month_start``; the starts are epoch seconds."""
    rows = (
        await session.execute(
            _QUOTA_TOTALS, {"day_start": _ts(day_start), "month_start": _ts(month_start)}
        )
    ).all()
    return [(key_id, int(month), int(day)) for key_id, month, day in rows]


UsageGroup = Literal["total", "day", "hour", "minute"]


@dataclass(frozen=True, slots=True)
class UsageSum:
    """One key's and model's usage over a period: the whole range (``total``) or one UTC day,
    hour or minute."""

    key_name: str
    key_id: str
    model: str
    start: datetime  # the period's start: its first bucket for total, else the truncated time
    last_bucket: datetime  # the minute of its last bucket
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def _sums_query(
    group: UsageGroup,
    key: str | None,
    model: str | None,
    since: datetime | None,
    until: datetime | None,
) -> Select[*tuple[Any, ...]]:
    b = UsageBucket
    period = (
        func.min(b.bucket_start).label("start")
        if group == "total"
        else func.date_trunc(group, b.bucket_start, "UTC").label("start")
    )
    cols = [
        ApiKey.name,
        b.api_key_id,
        b.model,
        func.min(b.bucket_start).label("first"),
        func.max(b.bucket_start).label("last"),
        func.sum(b.requests),
        func.sum(b.prompt_tokens),
        func.sum(b.cached_tokens),
        func.sum(b.completion_tokens),
    ]
    stmt = select(*cols).join(ApiKey, ApiKey.id == b.api_key_id)
    if key is not None:
        stmt = stmt.where(or_(ApiKey.name == key, ApiKey.id == key))
    if model is not None:
        stmt = stmt.where(b.model == model)
    if since is not None:
        stmt = stmt.where(b.bucket_start >= since)
    if until is not None:
        stmt = stmt.where(b.bucket_start < until)
    groups: list[Any] = [ApiKey.name, b.api_key_id, b.model]
    order: list[Any] = [ApiKey.name, b.model]
    if group != "total":
        stmt = stmt.add_columns(period)
        groups.append(period)
        order.append(period.desc())
    return stmt.group_by(*groups).order_by(*order)


async def usage_sums(
    session: AsyncSession,
    *,
    group: UsageGroup,
    key: str | None,
    model: str | None,
    since: datetime | None,
    until: datetime | None,
    limit: int,
) -> list[UsageSum]:
    """At most ``limit`` sums by key name and model, newest periods first within each; ``key``
    is a key's name or id, ``[since, until)`` bounds the buckets' minutes."""
    rows = (await session.execute(_sums_query(group, key, model, since, until).limit(limit))).all()
    sums = []
    for row in rows:
        name, key_id, model_name, first, last, requests, prompt, cached, completion = row[:9]
        sums.append(
            UsageSum(
                key_name=name,
                key_id=key_id,
                model=model_name,
                start=first if group == "total" else row[9],
                last_bucket=last,
                requests=int(requests),
                prompt_tokens=int(prompt),
                cached_tokens=int(cached),
                completion_tokens=int(completion),
            )
        )
    return sums
