"""``/admin/v1/debug/kv/{shard_id}`` (read-only): this process's KV prefix index for one shard.

Each control plane instance holds its own index, fed by agents' KV deltas (docs/architecture.md §5), so the
answer describes the instance that served the request only. It lists every block the index
holds for the shard, per medium, to compare with what the engine itself holds (the
simulator's ``/debug/kv_blocks``): the question "does the router see what the engine has?"
answered without guessing. The walk costs one pass over the model's table: a debug tool,
never for a request path. Admin token only, like every route under /admin/v1.
"""

from __future__ import annotations

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, ConfigDict

from llmgw.controlplane.agentapi.service import AgentApi
from llmgw.errors import NotFoundError

__all__ = ["ShardKvOut", "router"]

router = APIRouter(tags=["debug"])


class ShardKvOut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shard_id: str
    model: str
    partial: bool
    complete: bool
    version: int
    num_blocks: int
    blocks: dict[str, list[int]]


@router.get("/debug/kv/{shard_id}", response_model=ShardKvOut)
async def shard_kv(
    request: Request, shard_id: str = Path(min_length=1, max_length=128)
) -> ShardKvOut:
    """The blocks this instance's prefix index holds for a shard: medium -> sorted hashes."""
    api: AgentApi | None = getattr(request.app.state, "agent_api", None)
    view = api.intake.view(shard_id) if api is not None else None
    if view is None:
        raise NotFoundError(
            f"this control plane instance holds no KV view of shard {shard_id!r}: the shard is "
            "unknown, has no kv_events, or its agent has not sent a full copy here yet",
            field="shard_id",
        )
    return ShardKvOut(
        shard_id=view.shard_id,
        model=view.model,
        partial=view.partial,
        complete=view.complete,
        version=view.version,
        num_blocks=view.num_blocks,
        blocks=view.blocks,
    )
