"""Request and response bodies of the admin API (pydantic, at the boundary only).

Every request model forbids unknown fields: a misspelt ``replica`` must be a
422 naming it, not a silently ignored key and a deployment with the default
count. Updates carry the ``version`` the client last read (optimistic
concurrency); every other update field is optional and means "leave as is"
when absent.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from llmgw.controlplane.tables import NAME_PATTERN, ROLLOUT_BUDGET_PATTERN
from llmgw.engines import MAX_HASH_SEED, is_valid_hash_seed

__all__ = [
    "AdapterBody",
    "DeploymentCreate",
    "DeploymentOut",
    "DeploymentUpdate",
    "ErrorBody",
    "ErrorDetail",
    "ModelCreate",
    "ModelOut",
    "ModelUpdate",
    "ProfileCreate",
    "ProfileOut",
    "ProfileUpdate",
    "check_rollout_budget",
]

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
RolloutBudget = Annotated[str, StringConstraints(pattern=ROLLOUT_BUDGET_PATTERN)]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
Engine = Annotated[str, StringConstraints(min_length=1, max_length=64)]


_INT32_MAX = 2**31 - 1
# Parallelism beyond this is a typo, not a cluster; it also keeps every count inside Postgres'
# 32-bit integer columns, so a huge number is a 422 naming the field, not a database error.
_MAX_PARALLEL = 65_536


def _no_nul(value: object) -> object:
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("must not contain a NUL character (Postgres cannot store it)")
    elif isinstance(value, list | tuple):
        for v in value:
            _no_nul(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_nul(k)
            _no_nul(v)
    elif isinstance(value, BaseModel):
        _no_nul(value.model_dump())
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    _strings_storable = field_validator("*")(_no_nul)


class _Response(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorDetail(BaseModel):
    code: str = Field(
        description="Stable, machine-readable: spec-invalid, conflict, not-found, ..."
    )
    message: str
    field: str | None = Field(default=None, description="Dotted path of the offending input.")


class ErrorBody(BaseModel):
    error: ErrorDetail


# --- models -----------------------------------------------------------------


class ModelCreate(_Request):
    name: Name
    description: str = ""


class ModelUpdate(_Request):
    version: int = Field(
        ge=1, le=_INT32_MAX, description="The version you read; a stale one gets 409."
    )
    description: str | None = None


class ModelOut(_Response):
    name: str
    description: str
    version: int
    created_at: datetime
    updated_at: datetime


# --- profiles ---------------------------------------------------------------


class AdapterBody(_Request):
    name: Name
    path: Annotated[str, StringConstraints(min_length=1)]


class _ProfileFields(_Request):
    engine: Engine
    gpu_class: str = ""
    tp: int = Field(default=1, ge=1, le=_MAX_PARALLEL, description="Tensor-parallel degree.")
    pp: int = Field(default=1, ge=1, le=_MAX_PARALLEL, description="Pipeline-parallel degree.")
    gpus_per_node: int = Field(
        default=0, ge=0, le=_MAX_PARALLEL, description="0: tp x pp on one node."
    )
    nodes: int = Field(default=1, ge=1, le=_MAX_PARALLEL)
    model_path: Annotated[str, StringConstraints(min_length=1)]
    served_model_name: str = Field(default="", description="Empty: the model's name.")
    args: list[str] = Field(
        default_factory=list, description="Passed to the engine as argv, in order."
    )
    env: dict[EnvName, str] = Field(default_factory=dict)
    secret_env: dict[EnvName, str] = Field(
        default_factory=dict,
        description="Variable -> secret reference. Write-only: never returned, never logged. "
        "The fingerprint counts the variable names (adding one changes the process), never "
        "the references.",
    )
    adapters: list[AdapterBody] = Field(
        default_factory=list, description="LoRA adapters, in order."
    )
    kv_events: bool = False
    threads: int = Field(
        default=0, ge=0, le=_MAX_PARALLEL, description="CPU threads of a CPU-only shard."
    )
    kv_hash_seed: str | None = Field(
        default=None,
        description="PYTHONHASHSEED of the engines: an integer 1..4294967295 as a string. "
        "None: the cluster's random seed.",
    )
    kv_block_size: int = Field(default=16, ge=1, le=4096)
    kv_hash_algo: Literal["sha256_cbor"] = "sha256_cbor"
    kv_extra_key_format: Literal["tagged", "legacy"] = "tagged"
    description: str = ""

    @field_validator("kv_hash_seed")
    @classmethod
    def _seed_ok(cls, v: str | None) -> str | None:
        if v is not None and not is_valid_hash_seed(v):
            raise ValueError(
                f"must be a decimal integer from 1 to {MAX_HASH_SEED} without leading zeros: it "
                "becomes the engines' PYTHONHASHSEED, which Python refuses otherwise ('0' would "
                "also switch off string-hash randomization); leave it unset to use the "
                "cluster's random seed"
            )
        return v


class ProfileCreate(_ProfileFields):
    name: Name
    model: Name


class ProfileUpdate(_Request):
    version: int = Field(
        ge=1, le=_INT32_MAX, description="The version you read; a stale one gets 409."
    )
    engine: Engine | None = None
    gpu_class: str | None = None
    tp: int | None = Field(default=None, ge=1, le=_MAX_PARALLEL)
    pp: int | None = Field(default=None, ge=1, le=_MAX_PARALLEL)
    gpus_per_node: int | None = Field(default=None, ge=0, le=_MAX_PARALLEL)
    nodes: int | None = Field(default=None, ge=1, le=_MAX_PARALLEL)
    model_path: Annotated[str, StringConstraints(min_length=1)] | None = None
    served_model_name: str | None = None
    args: list[str] | None = None
    env: dict[EnvName, str] | None = None
    secret_env: dict[EnvName, str] | None = None
    adapters: list[AdapterBody] | None = None
    kv_events: bool | None = None
    threads: int | None = Field(default=None, ge=0, le=_MAX_PARALLEL)
    kv_hash_seed: str | None = None
    kv_block_size: int | None = Field(default=None, ge=1, le=4096)
    kv_hash_algo: Literal["sha256_cbor"] | None = None
    kv_extra_key_format: Literal["tagged", "legacy"] | None = None
    description: str | None = None

    _seed_ok = field_validator("kv_hash_seed")(_ProfileFields._seed_ok.__func__)  # type: ignore[attr-defined]


class ProfileOut(_Response):
    name: str
    model: str
    engine: str
    gpu_class: str
    tp: int
    pp: int
    gpus_per_node: int
    nodes: int
    model_path: str
    served_model_name: str
    args: list[str]
    env: dict[str, str]
    secret_env_keys: list[str] = Field(description="Names only: secret references are write-only.")
    adapters: list[AdapterBody]
    kv_events: bool
    threads: int
    kv_hash_seed: str
    kv_block_size: int
    kv_hash_algo: str
    kv_extra_key_format: str
    description: str
    fingerprint: str
    version: int
    created_at: datetime
    updated_at: datetime


# --- deployments ------------------------------------------------------------


def check_rollout_budget(surge: str | None, unavailable: str | None) -> None:
    zero = ("0", "0%")
    if surge in zero and unavailable in zero:
        raise ValueError(
            "max_surge and max_unavailable are both 0: a rollout could neither start a new "
            "replica nor stop an old one; allow at least one (e.g. max_surge: 1)"
        )


class DeploymentCreate(_Request):
    name: Name
    model: Name
    profile: Name
    pool: Name = "default"
    replicas: int = Field(default=1, ge=0, le=10_000)
    max_surge: RolloutBudget = Field(default="1", description='A count ("1") or a share ("25%").')
    max_unavailable: RolloutBudget = Field(
        default="0", description='A count ("0") or a share ("25%").'
    )
    progress_deadline_s: int = Field(default=600, gt=0, le=_INT32_MAX)
    state: Literal["active", "suspended"] = "active"

    @field_validator("max_unavailable")
    @classmethod
    def _can_progress(cls, v: str, info: ValidationInfo) -> str:
        check_rollout_budget(info.data.get("max_surge"), v)
        return v


class DeploymentUpdate(_Request):
    version: int = Field(
        ge=1, le=_INT32_MAX, description="The version you read; a stale one gets 409."
    )
    profile: Name | None = None
    pool: Name | None = None
    replicas: int | None = Field(default=None, ge=0, le=10_000)
    max_surge: RolloutBudget | None = None
    max_unavailable: RolloutBudget | None = None
    progress_deadline_s: int | None = Field(default=None, gt=0, le=_INT32_MAX)
    state: Literal["active", "suspended"] | None = None


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
    version: int
    created_at: datetime
    updated_at: datetime
