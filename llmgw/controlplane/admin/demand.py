"""``GET /admin/v1/demand``: what the gateways hold of each model, summed over the gateways
whose report (every 2 s, ``gateway.demand``) is fresh: queued requests (held ones, for a
model with no ready replica, among them), in flight, queued and uncached prefill tokens, the
engines' waiting requests, the routed hit rate, requests shed, and since when the model is
saturated (requests wait in a gateway's queue because
every replica is at its admission limit). ``llmgw status`` shows it.

What this module must NOT do: write.
"""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter
from pydantic import BaseModel, Field

from llmgw.controlplane.admin.common import Session
from llmgw.store.demand import read_demand

__all__ = ["DemandOut", "DemandReply", "router"]

router = APIRouter(tags=["demand"])

# Rows older than this are of a gateway that stopped or cannot reach Postgres: ignored.
FRESH_S = 10.0


class DemandOut(BaseModel):
    model: str
    queued: int = Field(description="Requests waiting in the gateways' queues.")
    in_flight: int = Field(description="Requests the gateways have at its replicas.")
    shed: int = Field(description="Requests shed with 503 since each gateway started.")
    saturated: bool = Field(description="Requests wait for a replica with room now.")
    saturated_since: datetime | None
    gateways: int = Field(description="Gateways whose fresh report counts.")
    held: int = Field(default=0, description="Requests held for the model with no ready replica.")
    queued_prefill_tokens: int = Field(
        default=0, description="Prompt tokens queued or sent and not past their prefill."
    )
    uncached_prefill_tokens: int = Field(
        default=0, description="The part of them no prefix cache holds (the autoscaler's target)."
    )
    engine_waiting: int = Field(
        default=0, description="Requests the engines report waiting (the largest gateway view)."
    )
    hit_rate: float | None = Field(
        default=None, description="Share of routed prompt tokens a prefix cache held."
    )


class DemandReply(BaseModel):
    items: list[DemandOut]


@router.get("/demand", response_model=DemandReply)
async def read(session: Session) -> DemandReply:
    rows = await read_demand(session, fresh_s=FRESH_S)
    return DemandReply(
        items=[
            DemandOut(
                model=r.model,
                queued=r.queued,
                in_flight=r.in_flight,
                shed=r.shed,
                saturated=r.saturated_since is not None,
                saturated_since=r.saturated_since,
                gateways=r.gateways,
                held=r.held,
                queued_prefill_tokens=r.queued_prefill_tokens,
                uncached_prefill_tokens=r.uncached_prefill_tokens,
                engine_waiting=r.engine_waiting,
                hit_rate=r.hit_rate,
            )
            for r in rows
        ]
    )
