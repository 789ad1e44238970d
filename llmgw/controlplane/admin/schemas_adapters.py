"""Request and response bodies of the admin API's declared adapters (``kind: adapter``): a LoRA
adapter's name, base model, source, replica bounds and pinning, and the read-only status of
its placement (the leader's count and reason, where it is desired, loaded or failing). The
shared bounds and bases: ``schemas``; the adapter path rule, shared with profiles' static
adapters: ``schemas_profiles``."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field, StrictBool, StrictInt, ValidationInfo, field_validator

from llmgw.controlplane.admin.schemas import (
    INT32_MAX,
    Description,
    Name,
    _Request,
    _Response,
)
from llmgw.controlplane.admin.schemas_profiles import AdapterPath

__all__ = [
    "MAX_ADAPTER_REPLICAS",
    "AdapterCreate",
    "AdapterFailureOut",
    "AdapterHolderOut",
    "AdapterOut",
    "AdapterStatusOut",
    "AdapterUpdate",
    "replica_bounds_problem",
]

# As a deployment's replica counts: far above any fleet, inside Postgres' 32-bit integers.
MAX_ADAPTER_REPLICAS = 10_000

_PATH_DOC = (
    "Where nodes find the adapter, in the forms a profile's `adapters` take: a directory on the "
    "nodes, or an http(s) URL (`#sha256=<hex>` pins its content). Checked here for what no node "
    "could use (empty, over 4096 characters); each node's agent.policy governs the rest."
)
_MIN_DOC = "Replicas of the base model to hold it loaded, at least. null: the default."
_MAX_DOC = "Replicas of the base model to hold it loaded, at most. null: the default."
_PINNED_DOC = "Keep it loaded on its replicas rather than unloading it for another adapter."


def replica_bounds_problem(min_replicas: int | None, max_replicas: int | None) -> str | None:
    """Why the two bounds cannot stand together, or None (null on either side: the default,
    which any bound on the other side allows; the table's CHECK holds the same rule)."""
    if min_replicas is not None and max_replicas is not None and max_replicas < min_replicas:
        return (
            f"max_replicas {max_replicas} is below min_replicas {min_replicas}; give "
            "max_replicas >= min_replicas, or null for the default"
        )
    return None


class AdapterCreate(_Request):
    """A LoRA adapter declared on its own. The leader places it on replicas of its base model
    whose profile sets `adapter_slots` (by demand, within `min_replicas`/`max_replicas`) and
    their agents load it into the running engines; `status` says where it stands."""

    name: Name = Field(description="What clients send as `model`; in the models' namespace.")
    model: Name = Field(description="The base model's name; it must exist.")
    path: AdapterPath = Field(description=_PATH_DOC)
    min_replicas: StrictInt | None = Field(
        default=None, ge=0, le=MAX_ADAPTER_REPLICAS, description=_MIN_DOC
    )
    max_replicas: StrictInt | None = Field(
        default=None, ge=1, le=MAX_ADAPTER_REPLICAS, description=_MAX_DOC
    )
    pinned: StrictBool = Field(default=False, description=_PINNED_DOC)
    description: Description = ""

    @field_validator("max_replicas")
    @classmethod
    def _bounds_ordered(cls, v: int | None, info: ValidationInfo) -> int | None:
        # min_replicas is declared first, so it is in info.data when it passed its own check.
        problem = replica_bounds_problem(info.data.get("min_replicas"), v)
        if problem is not None:
            raise ValueError(problem)
        return v


class AdapterUpdate(_Request):
    """Absent fields stay as they are. ``min_replicas``/``max_replicas`` given as null go back
    to the default; the others ignore null. The base model is fixed: an adapter is trained for
    one, so another base is another adapter (create it under another name)."""

    version: StrictInt = Field(
        ge=1, le=INT32_MAX, description="The version you read; a stale one gets 409."
    )
    path: AdapterPath | None = Field(default=None, description=_PATH_DOC)
    min_replicas: StrictInt | None = Field(
        default=None,
        ge=0,
        le=MAX_ADAPTER_REPLICAS,
        description=_MIN_DOC + " Absent: as it is.",
    )
    max_replicas: StrictInt | None = Field(
        default=None,
        ge=1,
        le=MAX_ADAPTER_REPLICAS,
        description=_MAX_DOC + " Absent: as it is.",
    )
    pinned: StrictBool | None = Field(default=None, description=_PINNED_DOC)
    description: Description | None = None


class AdapterHolderOut(_Response):
    replica: str = Field(description="The replica's id.")
    node: str = Field(description="The node its engine (rank 0) runs on.")


class AdapterFailureOut(AdapterHolderOut):
    reason: str = Field(description="The engine's (or the node policy's) answer to the load.")
    failures: int = Field(description="Failed loads in a row; the agent retries with backoff.")


class AdapterStatusOut(_Response):
    """Where the adapter stands, written by the leader and the agents (read-only)."""

    desired_replicas: int | None = Field(
        default=None,
        description="Replicas that should hold it, as the leader's placement last decided "
        "(by demand, within min_replicas/max_replicas). null: not placed yet.",
    )
    replicas: list[AdapterHolderOut] = Field(
        default_factory=list, description="Replicas whose engine is told to hold it."
    )
    loaded: list[AdapterHolderOut] = Field(
        default_factory=list, description="Replicas whose agent reports it loaded."
    )
    failures: list[AdapterFailureOut] = Field(
        default_factory=list, description="Replicas whose agent reports its last load failed."
    )
    unplaced: str = Field(
        default="",
        description="Why it has fewer replicas than desired or none, and what fixes it; "
        "empty when it has them.",
    )


class AdapterOut(_Response):
    name: str
    model: str
    path: str
    min_replicas: int | None
    max_replicas: int | None
    pinned: bool
    description: str
    version: int
    created_at: datetime
    updated_at: datetime
    status: AdapterStatusOut = Field(default_factory=AdapterStatusOut)
