"""Bodies of the fleet half of the admin API: nodes, bootstrap tokens, replicas and
their shards, the reconciler's action record, GPU classes, and ``apply``.

As in ``llmgw.controlplane.admin.schemas``: request models forbid unknown fields, every
string and collection is bounded, and nothing secret is ever in a response model
(a bootstrap token's plaintext only in the one reply that creates it).
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
)

from llmgw.controlplane.admin.schemas import LIMITS, Description, Name, _Request, _Response

__all__ = [
    "MAX_LOG_TAIL_CHARS",
    "MAX_TOKEN_TTL_S",
    "ActionOut",
    "ApplyBody",
    "ApplyChange",
    "ApplyProblem",
    "ApplyReply",
    "ApplyResult",
    "BootstrapTokenCreate",
    "BootstrapTokenCreated",
    "BootstrapTokenOut",
    "GpuClassCreate",
    "GpuClassOut",
    "GpuClassUpdate",
    "NodeOut",
    "NodeUpdate",
    "ReplicaOut",
    "ShardGpuOut",
    "ShardOut",
]

# A token lives for hours, the time a rollout of new machines takes; a month is the most
# anyone needs, and a longer one is a standing invitation to join the cluster.
MAX_TOKEN_TTL_S = 30 * 86_400
DEFAULT_TOKEN_TTL_S = 86_400
# What one shard's log tail may add to a reply: a page of replicas stays a few MB at most.
MAX_LOG_TAIL_CHARS = 8192
# GPU class patterns run against every GPU name on every placement: short and compilable.
MAX_PATTERN_CHARS = 512
# The built-in class of simulated GPUs; a stored class by that name would let real
# engines be placed on simulated GPUs or the reverse.
_RESERVED_CLASSES = ("sim",)

LabelKey = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,126}[A-Za-z0-9])?$")
]
LabelValue = Annotated[str, StringConstraints(max_length=LIMITS["short_text_chars"])]


# --- nodes ------------------------------------------------------------------


class NodeUpdate(_Request):
    labels: dict[LabelKey, LabelValue] | None = Field(
        default=None, max_length=64, description="Replaces the node's labels as a whole."
    )
    pool: Name | None = Field(default=None, description="Deployments place in their pool only.")


class NodeOut(_Response):
    name: str
    approval_state: str = Field(description="pending: registered, waiting for POST .../approve.")
    pool: str
    labels: dict[str, Any]
    cordoned: bool = Field(description="No new shards are placed here.")
    draining: bool = Field(description="Its shards are being moved off (implies cordoned).")
    desired_version: int
    created_at: datetime
    # --- what its agent reports (node_status; empty before the first sync) ---
    mgmt_addr: str = ""
    agent_version: str = ""
    agent_epoch: int = 0
    last_sync_at: datetime | None = None
    inventory: dict[str, Any] = Field(default_factory=dict)
    # --- computed ---
    num_gpus: int = Field(description="Placeable GPUs and MIG instances in the inventory.")
    free_gpus: int = Field(description="Of those, the ones no live shard holds.")
    num_shards: int = Field(description="Live (not released) shards placed here.")


# --- bootstrap tokens -------------------------------------------------------


class BootstrapTokenCreate(_Request):
    pool: Name = Field(default="default", description="The pool nodes joining with it get.")
    ttl_s: StrictInt = Field(
        default=DEFAULT_TOKEN_TTL_S,
        ge=60,
        le=MAX_TOKEN_TTL_S,
        description="Seconds until it expires (a minute to 30 days).",
    )
    uses: StrictInt | None = Field(
        default=1, ge=1, le=100_000, description="How many nodes may join with it; null: any."
    )
    require_approval: StrictBool = Field(
        default=False, description="Nodes joining with it wait for POST /nodes/{name}/approve."
    )
    description: Description = ""


class BootstrapTokenOut(_Response):
    id: str
    pool: str
    description: str
    require_approval: bool
    expires_at: datetime
    uses_left: int | None = Field(description="null: any number until it expires.")
    revoked: bool
    created_at: datetime


class BootstrapTokenCreated(BootstrapTokenOut):
    token: str = Field(description="The token itself. Shown in this reply only; store it now.")


# --- replicas and shards ----------------------------------------------------


class ShardGpuOut(BaseModel):
    index: int = Field(description="The physical GPU's NVML index (a MIG slice's parent's).")
    mig_uuid: str | None = None


class ShardAdapterOut(BaseModel):
    name: str
    state: str = Field(description="loading, loaded, failed or unloading, as the agent saw it.")
    reason: str = Field(description="Why the last load failed (the engine's or the node's words).")
    failures: int = Field(description="Failed loads in a row.")


class ShardOut(_Response):
    id: uuid.UUID
    node: str
    rank: int = Field(description="0 leads: it serves HTTP.")
    gpus: list[ShardGpuOut]
    desired_state: str
    observed_state: str
    reason: str = Field(description="The agent's words for the observed state.")
    restarts: int
    exit_code: int | None
    log_tail: str = Field(
        description=f"The end of the engine's log, at most {MAX_LOG_TAIL_CHARS} chars."
    )
    fingerprint: str = Field(description="The profile fingerprint it is desired with.")
    observed_fingerprint: str = Field(description="The one its running process started from.")
    released: bool
    leader_port: int | None
    http_port: int | None
    engine_version: str | None
    observed_at: datetime | None
    started_at: datetime | None
    exited_at: datetime | None
    desired_adapters: list[str] = Field(
        description="The runtime adapters the leader placed on its engine (rank 0)."
    )
    adapters: list[ShardAdapterOut] = Field(
        description="Its engine's runtime adapters as its agent last reported them (rank 0)."
    )


class ReplicaOut(_Response):
    id: uuid.UUID
    deployment: str | None = Field(description="null: its deployment was deleted.")
    state: str = Field(description="active, draining or stopping.")
    reason: str
    drain_deadline: datetime | None
    fingerprint: str = Field(description="The profile fingerprint it was created from.")
    current_fingerprint: str | None = Field(description="Its deployment's profile's, now.")
    stale: bool = Field(description="Created from another fingerprint: due for replacement.")
    ready: bool = Field(description="Every shard desired running and observed ready.")
    deployment_reason: str = Field(
        description="The deployment's status reason: why replicas it wants are not placed."
    )
    created_at: datetime
    shards: list[ShardOut]


# --- the reconciler's action record ----------------------------------------


class ActionOut(_Response):
    id: int
    at: datetime
    epoch: int
    action: str
    deployment: str
    replica_id: uuid.UUID | None
    node: str
    reason: str


# --- GPU classes ------------------------------------------------------------


def _regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(
            f"is not a regular expression (Python's re): {exc}; e.g. '^NVIDIA H100' matches "
            "NVML names such as 'NVIDIA H100 80GB HBM3'"
        ) from None
    return pattern


Pattern = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_PATTERN_CHARS),
    AfterValidator(_regex),
]


class GpuClassCreate(_Request):
    name: Name
    pattern: Pattern = Field(description="Python regular expression searched in NVML GPU names.")
    description: Description = ""

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v in _RESERVED_CLASSES:
            raise ValueError(
                f"{v!r} is the built-in class of simulated GPUs and cannot be redefined; "
                "pick another name"
            )
        return v


class GpuClassUpdate(_Request):
    pattern: Pattern | None = None
    description: Description | None = None


class GpuClassOut(_Response):
    name: str
    pattern: str
    description: str
    created_at: datetime


# --- apply ------------------------------------------------------------------


class ApplyBody(_Request):
    documents: list[dict[str, Any]] = Field(
        max_length=1000,
        description="Each: `kind: model|profile|adapter|deployment` and that kind's create fields.",
    )
    dry_run: StrictBool = Field(
        default=False, description="Compute the outcome and what changes, write nothing."
    )


class ApplyChange(BaseModel):
    """One field a configured object changes, as stored before and after."""

    field: str = Field(
        description="Dotted path of the field: `replicas`, `env.LOG_LEVEL`, `secret_env.HF_TOKEN`."
    )
    change: Literal["added", "removed", "changed"]
    old: Any = Field(default=None, description="The stored value; null when added or secret.")
    new: Any = Field(default=None, description="The value applied; null when removed or secret.")
    secret: bool = Field(
        default=False, description="A secret_env entry: its reference is write-only, never shown."
    )


class ApplyResult(BaseModel):
    index: int = Field(description="The document's position in the request.")
    kind: str
    name: str
    result: Literal["created", "configured", "unchanged"]
    changes: list[ApplyChange] = Field(
        default_factory=list,
        description="What a configured object changes, field by field; empty otherwise.",
    )
    rolls: int = Field(
        default=0,
        description="Replicas this change restarts on a new fingerprint (the desired count of "
        "each active deployment it rolls); 0: no roll. A profile counts the deployments that "
        "keep using it, a deployment only a switch to a profile of another fingerprint.",
    )
    rolled_deployments: list[str] = Field(
        default_factory=list, description="The deployments whose replicas `rolls` counts."
    )


class ApplyReply(BaseModel):
    dry_run: bool
    results: list[ApplyResult]


class ApplyProblem(BaseModel):
    index: int
    kind: str | None
    name: str | None
    field: str | None
    message: str
