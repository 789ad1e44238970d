"""``/admin/v1/replicas`` (read-only): serving copies and their shards, as placed and as seen.

Replicas are the reconciler's to create and remove; what an admin changes is the
deployment. Why a deployment's missing replicas are not placed is its status reason,
repeated on each of its replicas as ``deployment_reason``.
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
from llmgw.controlplane.admin.schemas_fleet import (
    MAX_LOG_TAIL_CHARS,
    ReplicaOut,
    ShardAdapterOut,
    ShardGpuOut,
    ShardOut,
)
from llmgw.store import fleet as fq

__all__ = ["router"]

router = APIRouter(tags=["replicas"])


def _desired_names(raw: object) -> list[str]:
    # Written by the leader as protocol.RuntimeAdapter objects; anything else is skipped
    # (a GET must not fail on one odd row).
    items = raw if isinstance(raw, list) else []
    return [str(a["name"]) for a in items if isinstance(a, dict) and a.get("name")]


def _observed(raw: object) -> list[ShardAdapterOut]:
    # Written by the agent API from protocol.AdapterObserved, already bounded there.
    items = raw if isinstance(raw, list) else []
    return [
        ShardAdapterOut(
            name=str(a["name"]),
            state=str(a.get("state") or ""),
            reason=str(a.get("reason") or ""),
            failures=int(a.get("failures") or 0),
        )
        for a in items
        if isinstance(a, dict) and a.get("name")
    ]


def _view(row: fq.ReplicaRow) -> ReplicaOut:
    r = row.replica
    shards = [
        ShardOut(
            id=s.id,
            node=node,
            rank=s.rank,
            gpus=[ShardGpuOut(index=i, mig_uuid=m) for i, m in gpus],
            desired_state=s.desired_state,
            observed_state=s.observed_state,
            reason=s.observed_reason,
            restarts=s.restarts,
            exit_code=s.exit_code,
            log_tail=s.log_tail[-MAX_LOG_TAIL_CHARS:],
            fingerprint=s.profile_fingerprint,
            observed_fingerprint=s.observed_fingerprint,
            released=s.released,
            leader_port=s.leader_port,
            http_port=s.http_port,
            engine_version=s.engine_version,
            observed_at=s.observed_at,
            started_at=s.started_at,
            exited_at=s.exited_at,
            desired_adapters=_desired_names(s.desired_adapters),
            adapters=_observed(s.observed_adapters),
        )
        for s, node, gpus in row.shards
    ]
    live = [s for s in shards if not s.released]
    return ReplicaOut(
        id=r.id,
        deployment=row.deployment,
        state=r.state,
        reason=r.reason,
        drain_deadline=r.drain_deadline,
        fingerprint=r.profile_fingerprint,
        current_fingerprint=row.current_fingerprint,
        stale=row.current_fingerprint is not None
        and r.profile_fingerprint != row.current_fingerprint,
        ready=bool(live)
        and all(s.desired_state == "running" and s.observed_state == "ready" for s in live),
        deployment_reason=row.deployment_reason,
        created_at=r.created_at,
        shards=shards,
    )


DeploymentFilter = Annotated[
    str | None, Query(max_length=128, description="Only this deployment's replicas.")
]


@router.get("/replicas", response_model=Page[ReplicaOut])
async def list_replicas(
    session: Session,
    deployment: DeploymentFilter = None,
    limit: Limit = DEFAULT_PAGE,
    cursor: Cursor = None,
) -> Page[ReplicaOut]:
    rows = await fq.list_replicas(
        session, deployment=deployment, after=decode_cursor(cursor), limit=limit + 1
    )
    return page(rows, limit, lambda r: str(r.replica.id), [_view(r) for r in rows[:limit]])


router.get("/replicas/", response_model=Page[ReplicaOut], include_in_schema=False)(list_replicas)


@router.get("/replicas/{replica_id}", response_model=ReplicaOut)
async def get_replica(replica_id: str, session: Session) -> ReplicaOut:
    return _view(await fq.get_replica(session, replica_id))
