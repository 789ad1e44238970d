"""Request and response bodies of the admin API's deployments: the spec (replicas, rollout
budgets, the autoscale policy), scaling, and the status the reconciler and the autoscaler
last wrote. The shared bounds and bases: ``schemas``."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from llmgw.controlplane.admin.schemas import INT32_MAX, Name, _Request, _Response
from llmgw.store.tables import ROLLOUT_BUDGET_PATTERN

__all__ = [
    "AutoscaleBody",
    "AutoscaleStatusOut",
    "DeploymentCreate",
    "DeploymentOut",
    "DeploymentStatusOut",
    "DeploymentUpdate",
    "RolloutBudget",
    "ScaleBody",
    "check_rollout_budget",
]

RolloutBudget = Annotated[str, StringConstraints(pattern=ROLLOUT_BUDGET_PATTERN)]


def check_rollout_budget(surge: str | None, unavailable: str | None) -> None:
    zero = ("0", "0%")
    if surge in zero and unavailable in zero:
        raise ValueError(
            "max_surge and max_unavailable are both 0: a rollout could neither start a new "
            "replica nor stop an old one; allow at least one (e.g. max_surge: 1)"
        )


# An hour: longer windows would need a history the leader keeps in memory for each model.
_MAX_WINDOW_S = 3600
# A week: longer than any idle gap worth keeping a replica placed for.
_MAX_IDLE_S = 7 * 24 * 3600


class AutoscaleBody(_Request):
    """A deployment's ``autoscale:`` mapping: replicas follow the gateways' demand between
    ``min_replicas`` and ``max_replicas``; ``replicas`` is only where they start."""

    min_replicas: StrictInt = Field(ge=0, le=10_000, description="0 allows scale to zero.")
    max_replicas: StrictInt = Field(ge=1, le=10_000)
    target_queued_prefill_tokens: StrictInt | None = Field(
        default=None,
        ge=1,
        le=100_000_000,
        description="Per serving replica: prompt tokens waiting for prefill that no prefix "
        "cache holds.",
    )
    target_waiting_requests: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description="Per serving replica: requests not yet running (queued or held).",
    )
    scale_up_window_s: StrictFloat = Field(
        default=30, ge=0, le=_MAX_WINDOW_S,
        description="Demand must stay above the target this long before a step up.",
    )  # fmt: skip
    scale_down_window_s: StrictFloat = Field(
        default=300, ge=0, le=_MAX_WINDOW_S,
        description="Demand must stay below the target this long before a step down.",
    )  # fmt: skip
    suspend_after_s: StrictFloat | None = Field(
        default=None, gt=0, le=_MAX_IDLE_S,
        description="Idle this long: replicas above min suspended (engine asleep, kept "
        "placed; engines without a suspend are stopped).",
    )  # fmt: skip
    zero_after_s: StrictFloat | None = Field(
        default=None, gt=0, le=_MAX_IDLE_S,
        description="Idle this long: replicas above min stopped.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _coherent(self) -> AutoscaleBody:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas {self.max_replicas} is below min_replicas {self.min_replicas}; "
                "give max_replicas >= min_replicas"
            )
        if self.target_queued_prefill_tokens is None and self.target_waiting_requests is None:
            raise ValueError(
                "autoscale needs a target to scale on: give target_queued_prefill_tokens "
                "(e.g. 8000) and/or target_waiting_requests (e.g. 4)"
            )
        if (
            self.suspend_after_s is not None
            and self.zero_after_s is not None
            and self.zero_after_s < self.suspend_after_s
        ):
            raise ValueError(
                f"zero_after_s {self.zero_after_s:g} is shorter than suspend_after_s "
                f"{self.suspend_after_s:g}: a replica would stop before it could be suspended; "
                "give zero_after_s >= suspend_after_s"
            )
        return self


class DeploymentCreate(_Request):
    name: Name
    model: Name
    profile: Name
    pool: Name = "default"
    replicas: StrictInt = Field(default=1, ge=0, le=10_000)
    max_surge: RolloutBudget = Field(default="1", description='A count ("1") or a share ("25%").')
    max_unavailable: RolloutBudget = Field(
        default="0", description='A count ("0") or a share ("25%").'
    )
    progress_deadline_s: StrictInt = Field(default=600, gt=0, le=INT32_MAX)
    state: Literal["active", "suspended"] = "active"
    autoscale: AutoscaleBody | None = Field(
        default=None, description="Demand-driven replicas; without it `replicas` is fixed."
    )

    @field_validator("max_unavailable")
    @classmethod
    def _can_progress(cls, v: str, info: ValidationInfo) -> str:
        check_rollout_budget(info.data.get("max_surge"), v)
        return v


class DeploymentUpdate(_Request):
    version: StrictInt = Field(
        ge=1, le=INT32_MAX, description="The version you read; a stale one gets 409."
    )
    profile: Name | None = None
    pool: Name | None = None
    replicas: StrictInt | None = Field(default=None, ge=0, le=10_000)
    max_surge: RolloutBudget | None = None
    max_unavailable: RolloutBudget | None = None
    progress_deadline_s: StrictInt | None = Field(default=None, gt=0, le=INT32_MAX)
    state: Literal["active", "suspended"] | None = None
    autoscale: AutoscaleBody | None = None
    # PATCH leaves an absent field as it is, so removing the policy needs its own word.
    remove_autoscale: StrictBool = Field(
        default=False, description="Drop the autoscale policy: `replicas` is fixed again."
    )


class ScaleBody(_Request):
    replicas: StrictInt = Field(ge=0, le=10_000, description="The desired replica count.")


class DeploymentStatusOut(_Response):
    """The rollout status the reconciler last wrote (all zeros before its first pass)."""

    observed_generation: int = Field(
        default=0, description="The generation these counts describe; below `generation`: stale."
    )
    replicas: int = Field(default=0, description="Replicas that exist (any state).")
    ready_replicas: int = 0
    updated_replicas: int = Field(default=0, description="Replicas on the current fingerprint.")
    available_replicas: int = 0
    unavailable_replicas: int = 0
    suspended_replicas: int = Field(
        default=0, description="Replicas kept placed with their engines suspended."
    )
    stalled: bool = Field(default=False, description="The progress deadline passed.")
    reason: str = Field(
        default="", description="Why it is not done: unplaceable replicas, a stall, a crash loop."
    )
    updated_at: datetime | None = None


class AutoscaleStatusOut(_Response):
    """The autoscaler's view of a deployment, as the leader last decided it."""

    desired_replicas: int = Field(description="Replicas that should serve now.")
    warm_replicas: int = Field(description="Replicas kept placed: serving plus suspended.")
    last_scaled_at: datetime | None = None
    idle_since: datetime | None = None
    suspended_since: datetime | None = None
    reason: str = Field(default="", description="Why the count last moved.")
    updated_at: datetime | None = None


class DeploymentOut(_Response):
    name: str
    model: str
    profile: str
    pool: str
    replicas: int
    max_surge: str
    max_unavailable: str
    progress_deadline_s: int
    state: str
    generation: int = Field(description="Bumped by every change of the spec or of its profile.")
    status: DeploymentStatusOut
    autoscale: AutoscaleBody | None = None
    autoscale_status: AutoscaleStatusOut | None = Field(
        default=None, description="The leader's last decision; None: not autoscaled."
    )
    version: int
    created_at: datetime
    updated_at: datetime
