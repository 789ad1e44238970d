"""The SQL of ``gateway_demand``: each gateway's per-model queue and in-flight counts,
written in one statement every few seconds (``gateway.demand.DemandReporter``), read summed
per model by the admin API (``llmgw status``) and by the leader's autoscaler.

A row's ``model`` is the name clients send: a model's, or a LoRA adapter's (issue [lora]). An
adapter's row counts its own requests, and its base model's row counts them too (the base's
autoscaler sees all the load its replicas run), so a reader must never add an adapter's row
into its base's.

What this module must NOT do: commit (callers own the transaction), or trust a row older
than the freshness bound a reader gives (its gateway may be gone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncSession

__all__ = [
    "DEMAND_CHANNEL",
    "STALE_ROW_S",
    "DemandRow",
    "ModelDemand",
    "read_demand",
    "write_demand",
]

# NOTIFYed by a gateway that holds a request for a model with no ready replica: the leader's
# reconcile loop listens, so a scale from zero starts within a pass, not a tick later.
DEMAND_CHANNEL = "llmgw_demand_waiting"
# Rows of other instances older than this are deleted by every write: an instance that went
# away for good (a host replaced) must not leave its rows forever.
STALE_ROW_S = 3600


@dataclass(frozen=True, slots=True)
class DemandRow:
    model: str
    queued: int
    in_flight: int
    shed: int
    saturated_s: float | None  # seconds the model has been saturated; None: it is not
    # Prompt tokens queued here or sent and not past prefill; the part no prefix cache holds.
    queued_prefill_tokens: int = 0
    uncached_prefill_tokens: int = 0
    # Requests queued for a model with no ready replica (a subset of queued).
    held: int = 0
    # What the model's engines reported waiting in their own queues at the last scrape.
    engine_waiting: int = 0
    hit_rate: float | None = None
    # Requests received for the name per second lately (a moving average over about a minute):
    # what the leader sizes an adapter's holders by.
    requests_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """A model's demand over every gateway whose row is fresh."""

    model: str
    queued: int
    in_flight: int
    shed: int
    saturated_since: datetime | None  # the earliest fresh saturation; None: not saturated
    gateways: int
    queued_prefill_tokens: int = 0
    uncached_prefill_tokens: int = 0
    held: int = 0
    # The largest over gateways: every gateway scrapes the same engines.
    engine_waiting: int = 0
    hit_rate: float | None = None  # the mean over the gateways that routed anything
    # Summed: each gateway counts the requests it received.
    requests_per_s: float = 0.0


# One statement for every model of the instance: jsonb_to_recordset unpacks the batch, so
# the write is one round trip however many models there are.
_WRITE = text(
    "WITH gone AS (DELETE FROM gateway_demand WHERE instance_id <> :instance "
    "AND updated_at < now() - make_interval(secs => :stale_s)) "
    "INSERT INTO gateway_demand "
    "(instance_id, model, queued, in_flight, shed, saturated_since, queued_prefill_tokens, "
    "uncached_prefill_tokens, held, engine_waiting, hit_rate, requests_per_s, updated_at) "
    "SELECT :instance, r.model, r.queued, r.in_flight, r.shed, "
    "CASE WHEN r.saturated_s IS NULL THEN NULL "
    "ELSE now() - make_interval(secs => r.saturated_s) END, r.queued_prefill_tokens, "
    "r.uncached_prefill_tokens, r.held, r.engine_waiting, r.hit_rate, r.requests_per_s, now() "
    "FROM jsonb_to_recordset(:rows) AS r(model text, queued int, in_flight int, shed bigint, "
    "saturated_s float8, queued_prefill_tokens bigint, uncached_prefill_tokens bigint, "
    "held int, engine_waiting int, hit_rate float8, requests_per_s float8) "
    "ON CONFLICT (instance_id, model) DO UPDATE SET queued = excluded.queued, "
    "in_flight = excluded.in_flight, shed = excluded.shed, "
    "saturated_since = CASE WHEN excluded.saturated_since IS NULL THEN NULL "
    "ELSE coalesce(gateway_demand.saturated_since, excluded.saturated_since) END, "
    "queued_prefill_tokens = excluded.queued_prefill_tokens, "
    "uncached_prefill_tokens = excluded.uncached_prefill_tokens, held = excluded.held, "
    "engine_waiting = excluded.engine_waiting, hit_rate = excluded.hit_rate, "
    "requests_per_s = excluded.requests_per_s, updated_at = excluded.updated_at"
).bindparams(bindparam("rows", type_=JSONB))

_READ = text(
    "SELECT model, sum(queued)::bigint AS queued, sum(in_flight)::bigint AS in_flight, "
    "sum(shed)::bigint AS shed, min(saturated_since) AS saturated_since, "
    "count(*) AS gateways, sum(queued_prefill_tokens)::bigint AS queued_prefill_tokens, "
    "sum(uncached_prefill_tokens)::bigint AS uncached_prefill_tokens, "
    "sum(held)::bigint AS held, max(engine_waiting) AS engine_waiting, "
    "avg(hit_rate) AS hit_rate, sum(requests_per_s) AS requests_per_s FROM gateway_demand "
    "WHERE updated_at > now() - make_interval(secs => :fresh_s) GROUP BY model ORDER BY model"
)


async def write_demand(
    session: AsyncSession, instance_id: str, rows: Sequence[DemandRow], *, notify: bool = False
) -> None:
    """Upsert this instance's rows (and delete other instances' stale ones); ``notify``:
    wake the leader too (a request is held for a model with no ready replica)."""
    if notify:
        await session.execute(text("SELECT pg_notify(:channel, '')"), {"channel": DEMAND_CHANNEL})
    if not rows:
        return
    batch = [
        {
            "model": r.model,
            "queued": r.queued,
            "in_flight": r.in_flight,
            "shed": r.shed,
            "saturated_s": r.saturated_s,
            "queued_prefill_tokens": r.queued_prefill_tokens,
            "uncached_prefill_tokens": r.uncached_prefill_tokens,
            "held": r.held,
            "engine_waiting": r.engine_waiting,
            "hit_rate": r.hit_rate,
            # The column's CHECK (>= 0); NaN is no rate (json would not even carry it).
            "requests_per_s": r.requests_per_s if r.requests_per_s > 0 else 0.0,
        }
        for r in sorted(rows, key=lambda r: r.model)  # one lock order for every writer
    ]
    await session.execute(_WRITE, {"instance": instance_id, "rows": batch, "stale_s": STALE_ROW_S})


async def read_demand(session: AsyncSession, *, fresh_s: float) -> list[ModelDemand]:
    result = await session.execute(_READ, {"fresh_s": fresh_s})
    return [
        ModelDemand(
            model=r.model,
            queued=int(r.queued),
            in_flight=int(r.in_flight),
            shed=int(r.shed),
            saturated_since=r.saturated_since,
            gateways=int(r.gateways),
            queued_prefill_tokens=int(r.queued_prefill_tokens),
            uncached_prefill_tokens=int(r.uncached_prefill_tokens),
            held=int(r.held),
            engine_waiting=int(r.engine_waiting),
            hit_rate=None if r.hit_rate is None else float(r.hit_rate),
            requests_per_s=float(r.requests_per_s or 0.0),
        )
        for r in result
    ]
