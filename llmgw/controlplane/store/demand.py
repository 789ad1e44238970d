"""The SQL of ``gateway_demand``: each gateway's per-model queue and in-flight counts,
written in one statement every few seconds (``gateway.demand.DemandReporter``), read summed
per model by the admin API (``llmgw status``) and by a later autoscaler.

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

__all__ = ["DemandRow", "ModelDemand", "read_demand", "write_demand"]


@dataclass(frozen=True, slots=True)
class DemandRow:
    model: str
    queued: int
    in_flight: int
    shed: int
    saturated_s: float | None  # seconds the model has been saturated; None: it is not


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """A model's demand over every gateway whose row is fresh."""

    model: str
    queued: int
    in_flight: int
    shed: int
    saturated_since: datetime | None  # the earliest fresh saturation; None: not saturated
    gateways: int


# One statement for every model of the instance: jsonb_to_recordset unpacks the batch, so
# the write is one round trip however many models there are.
_WRITE = text(
    "INSERT INTO gateway_demand "
    "(instance_id, model, queued, in_flight, shed, saturated_since, updated_at) "
    "SELECT :instance, r.model, r.queued, r.in_flight, r.shed, "
    "CASE WHEN r.saturated_s IS NULL THEN NULL "
    "ELSE now() - make_interval(secs => r.saturated_s) END, now() "
    "FROM jsonb_to_recordset(:rows) AS r(model text, queued int, in_flight int, shed bigint, "
    "saturated_s float8) "
    "ON CONFLICT (instance_id, model) DO UPDATE SET queued = excluded.queued, "
    "in_flight = excluded.in_flight, shed = excluded.shed, "
    "saturated_since = CASE WHEN excluded.saturated_since IS NULL THEN NULL "
    "ELSE coalesce(gateway_demand.saturated_since, excluded.saturated_since) END, "
    "updated_at = excluded.updated_at"
).bindparams(bindparam("rows", type_=JSONB))

_READ = text(
    "SELECT model, sum(queued)::bigint AS queued, sum(in_flight)::bigint AS in_flight, "
    "sum(shed)::bigint AS shed, min(saturated_since) AS saturated_since, "
    "count(*) AS gateways FROM gateway_demand "
    "WHERE updated_at > now() - make_interval(secs => :fresh_s) GROUP BY model ORDER BY model"
)


async def write_demand(session: AsyncSession, instance_id: str, rows: Sequence[DemandRow]) -> None:
    if not rows:
        return
    batch = [
        {
            "model": r.model,
            "queued": r.queued,
            "in_flight": r.in_flight,
            "shed": r.shed,
            "saturated_s": r.saturated_s,
        }
        for r in sorted(rows, key=lambda r: r.model)  # one lock order for every writer
    ]
    await session.execute(_WRITE, {"instance": instance_id, "rows": batch})


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
        )
        for r in result
    ]
