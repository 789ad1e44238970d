"""Request and response bodies of the admin API (pydantic, at the boundary only).

Every request model forbids unknown fields: a misspelt ``replica`` must be a
422 naming it, not a silently ignored key and a deployment with the default
count. Updates carry the ``version`` the client last read (optimistic
concurrency); every other update field is optional and means "leave as is"
when absent.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from llmgw.engines import (
    MAX_HASH_SEED,
    canonical_engine,
    is_valid_hash_seed,
    tokenizer_problem,
)
from llmgw.store.tables import NAME_PATTERN, ROLLOUT_BUDGET_PATTERN

__all__ = [
    "LIMITS",
    "AdapterBody",
    "AutoscaleBody",
    "AutoscaleStatusOut",
    "DeploymentCreate",
    "DeploymentOut",
    "DeploymentStatusOut",
    "DeploymentUpdate",
    "ErrorBody",
    "ErrorDetail",
    "ModelCreate",
    "ModelOut",
    "ModelUpdate",
    "MultinodeBackend",
    "Page",
    "ProfileCreate",
    "ProfileOut",
    "ProfileUpdate",
    "ScaleBody",
    "check_rollout_budget",
    "name_problem",
]

# Bounds on what one request may store. Each is far above any real profile (vLLM's longest
# command lines run to a few dozen args), and low enough that a body at the size cap cannot
# become a row that every agent sync then copies to every node. A value past one is a 422
# naming the field and the bound ("args.3: String should have at most 4096 characters").
LIMITS: dict[str, int] = {
    "description_chars": 4096,
    "args_items": 512,
    "arg_chars": 4096,
    "env_items": 256,
    "env_name_chars": 256,
    "env_value_chars": 8192,
    "secret_ref_chars": 1024,
    "adapters_items": 128,
    "path_chars": 4096,
    "short_text_chars": 256,
}


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an object's name, or None when it can.

    Names may hold slashes (Hugging Face's "org/model"), but never an empty, "." or ".."
    segment: ordinary clients normalise such paths before sending them, so
    `DELETE /admin/v1/models/a/../b` would arrive as a delete of model "b".
    """
    if not name:
        return "a name must not be empty"
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            return (
                f"a name must not have an empty, '.' or '..' segment between slashes (got "
                f"{segment!r}): HTTP clients rewrite such paths, so the object could not be "
                "addressed reliably; use e.g. 'org/model-v1'"
            )
    return None


def _segments_ok(name: str) -> str:
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN), AfterValidator(_segments_ok)]
RolloutBudget = Annotated[str, StringConstraints(pattern=ROLLOUT_BUDGET_PATTERN)]
EnvName = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=LIMITS["env_name_chars"]),
]
EnvValue = Annotated[str, StringConstraints(max_length=LIMITS["env_value_chars"])]
SecretRef = Annotated[str, StringConstraints(max_length=LIMITS["secret_ref_chars"])]
Arg = Annotated[str, StringConstraints(max_length=LIMITS["arg_chars"])]
Path_ = Annotated[str, StringConstraints(min_length=1, max_length=LIMITS["path_chars"])]
ShortText = Annotated[str, StringConstraints(max_length=LIMITS["short_text_chars"])]
Description = Annotated[str, StringConstraints(max_length=LIMITS["description_chars"])]
# An alias (``llama.cpp``) is stored as the engine's own name (``llamacpp``).
Engine = Annotated[
    str, StringConstraints(min_length=1, max_length=64), AfterValidator(canonical_engine)
]


def _tokenizer_ok(value: str) -> str:
    problem = tokenizer_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


# A profile's tokenizer: "", "none" or an absolute path (llmgw.engines.tokenizer_problem), no
# longer than any other path.
Tokenizer = Annotated[
    str, StringConstraints(max_length=LIMITS["path_chars"]), AfterValidator(_tokenizer_ok)
]
_TOKENIZER_DOC = (
    "Where the gateways' tokenizer for this model comes from. Empty: the engine's own (its "
    "--tokenizer argument, else model_path; the simulator's packaged tiny model). `none` "
    "(lower case): the model has no local tokenizer: agents ship no files for its shards and "
    "the gateways tokenize its prompts with a replica's /tokenize (then the approximate tree), "
    "even where files were stored before. An absolute path (no line breaks, at most 4096 "
    "characters): the directory on the nodes whose tokenizer files (tokenizer.json, "
    "tokenizer_config.json, a chat template) the agent ships instead, e.g. a Hugging Face "
    "tokenizer directory for a GGUF model; under a node's agent.policy.allowed_model_roots "
    "where it sets them. The engine's command line does not change. Not in the fingerprint: "
    "editing it rolls nothing. `none` and back take effect in the gateways within seconds; a "
    "new path is read for shards placed after the edit (a shard's launch spec is fixed when "
    "it is placed, and its agent ships once, when the shard is first ready)."
)

# How a multi-node vLLM replica is wired (llmgw.engines.MultinodeBackend); the table's CHECK
# holds the same two values.
MultinodeBackend = Literal["ray", "native"]


_INT32_MAX = 2**31 - 1
# Parallelism beyond this is a typo, not a cluster; it also keeps every count inside Postgres'
# 32-bit integer columns, so a huge number is a 422 naming the field, not a database error.
_MAX_PARALLEL = 65_536


def _storable(value: object) -> object:
    # Never put the value in the message: it may be a secret reference.
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("must not contain a NUL character (Postgres cannot store it)")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            # JSON allows "\ud800"; UTF-8 and Postgres do not. Unchecked, it failed inside the
            # database as a 500, with the value quoted in Postgres' own log.
            raise ValueError(
                "must be valid Unicode: it holds a lone surrogate (a \\ud800-\\udfff escape "
                "without its pair), which cannot be stored; send the character itself or its "
                "full surrogate pair"
            ) from None
    elif isinstance(value, list | tuple):
        for v in value:
            _storable(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _storable(k)
            _storable(v)
    elif isinstance(value, BaseModel):
        _storable(value.model_dump())
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    _strings_storable = field_validator("*")(_storable)


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


_Item = TypeVar("_Item")


class Page(BaseModel, Generic[_Item]):
    """One page of a list, in name order."""

    items: list[_Item]
    next_cursor: str | None = Field(
        description="Opaque: pass it as ?cursor= for the next page. None: this is the last page."
    )


# --- models -----------------------------------------------------------------


class ModelCreate(_Request):
    name: Name
    description: Description = ""


class ModelUpdate(_Request):
    version: int = Field(
        ge=1, le=_INT32_MAX, description="The version you read; a stale one gets 409."
    )
    description: Description | None = None


class ModelOut(_Response):
    name: str
    description: str
    version: int
    created_at: datetime
    updated_at: datetime


# --- profiles ---------------------------------------------------------------


class AdapterBody(_Request):
    name: Name
    path: Path_


class _ProfileFields(_Request):
    engine: Engine
    gpu_class: ShortText = ""
    tp: int = Field(default=1, ge=1, le=_MAX_PARALLEL, description="Tensor-parallel degree.")
    pp: int = Field(default=1, ge=1, le=_MAX_PARALLEL, description="Pipeline-parallel degree.")
    gpus_per_node: int = Field(
        default=0, ge=0, le=_MAX_PARALLEL, description="0: tp x pp on one node."
    )
    nodes: int = Field(default=1, ge=1, le=_MAX_PARALLEL)
    model_path: Path_
    served_model_name: ShortText = Field(default="", description="Empty: the model's name.")
    args: list[Arg] = Field(
        default_factory=list,
        max_length=LIMITS["args_items"],
        description="Passed to the engine as argv, in order.",
    )
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=LIMITS["env_items"])
    secret_env: dict[EnvName, SecretRef] = Field(
        default_factory=dict,
        max_length=LIMITS["env_items"],
        description="Variable -> secret reference: `env:NAME` (the agent's environment) or "
        "`file:/path` (a file on the node), resolved by the node at launch; a value that is "
        "not a reference is refused. Write-only: never returned, never logged. "
        "The fingerprint counts the variable names (adding one changes the process), never "
        "the references.",
    )
    adapters: list[AdapterBody] = Field(
        default_factory=list,
        max_length=LIMITS["adapters_items"],
        description="LoRA adapters, in order.",
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
    multinode_backend: MultinodeBackend = Field(
        default="ray",
        description="How a replica spanning nodes is wired: a Ray cluster, or the engine's own "
        "multi-node launch (vLLM's --nnodes/--node-rank). Ignored on one node.",
    )
    max_in_flight: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Requests (running plus waiting) the gateways send one replica at most; "
        "the rest wait in the gateway's fair queue. 0: the engine's default, its batch limit "
        "(vLLM --max-num-seqs, ...) plus half of it waiting. Not in the fingerprint: editing "
        "it rolls nothing, the gateways apply it within seconds.",
    )
    tokenizer: Tokenizer = Field(default="", description=_TOKENIZER_DOC)
    description: Description = ""

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
    gpu_class: ShortText | None = None
    tp: int | None = Field(default=None, ge=1, le=_MAX_PARALLEL)
    pp: int | None = Field(default=None, ge=1, le=_MAX_PARALLEL)
    gpus_per_node: int | None = Field(default=None, ge=0, le=_MAX_PARALLEL)
    nodes: int | None = Field(default=None, ge=1, le=_MAX_PARALLEL)
    model_path: Path_ | None = None
    served_model_name: ShortText | None = None
    args: list[Arg] | None = Field(default=None, max_length=LIMITS["args_items"])
    env: dict[EnvName, EnvValue] | None = Field(default=None, max_length=LIMITS["env_items"])
    secret_env: dict[EnvName, SecretRef] | None = Field(
        default=None, max_length=LIMITS["env_items"]
    )
    adapters: list[AdapterBody] | None = Field(default=None, max_length=LIMITS["adapters_items"])
    kv_events: bool | None = None
    threads: int | None = Field(default=None, ge=0, le=_MAX_PARALLEL)
    kv_hash_seed: str | None = None
    kv_block_size: int | None = Field(default=None, ge=1, le=4096)
    kv_hash_algo: Literal["sha256_cbor"] | None = None
    kv_extra_key_format: Literal["tagged", "legacy"] | None = None
    multinode_backend: MultinodeBackend | None = None
    max_in_flight: int | None = Field(default=None, ge=0, le=1_000_000)
    tokenizer: Tokenizer | None = None
    description: Description | None = None

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
    multinode_backend: str
    max_in_flight: int
    tokenizer: str
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


# An hour: longer windows would need a history the leader keeps in memory for each model.
_MAX_WINDOW_S = 3600
# A week: longer than any idle gap worth keeping a replica placed for.
_MAX_IDLE_S = 7 * 24 * 3600


class AutoscaleBody(_Request):
    """A deployment's ``autoscale:`` mapping: replicas follow the gateways' demand between
    ``min_replicas`` and ``max_replicas``; ``replicas`` is only where they start."""

    min_replicas: int = Field(ge=0, le=10_000, description="0 allows scale to zero.")
    max_replicas: int = Field(ge=1, le=10_000)
    target_queued_prefill_tokens: int | None = Field(
        default=None,
        ge=1,
        le=100_000_000,
        description="Per serving replica: prompt tokens waiting for prefill that no prefix "
        "cache holds.",
    )
    target_waiting_requests: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description="Per serving replica: requests not yet running (queued or held).",
    )
    scale_up_window_s: float = Field(
        default=30, ge=0, le=_MAX_WINDOW_S,
        description="Demand must stay above the target this long before a step up.",
    )  # fmt: skip
    scale_down_window_s: float = Field(
        default=300, ge=0, le=_MAX_WINDOW_S,
        description="Demand must stay below the target this long before a step down.",
    )  # fmt: skip
    suspend_after_s: float | None = Field(
        default=None, gt=0, le=_MAX_IDLE_S,
        description="Idle this long: replicas above min suspended (engine asleep, kept "
        "placed; engines without a suspend are stopped).",
    )  # fmt: skip
    zero_after_s: float | None = Field(
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
    replicas: int = Field(default=1, ge=0, le=10_000)
    max_surge: RolloutBudget = Field(default="1", description='A count ("1") or a share ("25%").')
    max_unavailable: RolloutBudget = Field(
        default="0", description='A count ("0") or a share ("25%").'
    )
    progress_deadline_s: int = Field(default=600, gt=0, le=_INT32_MAX)
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
    autoscale: AutoscaleBody | None = None
    # PATCH leaves an absent field as it is, so removing the policy needs its own word.
    remove_autoscale: bool = Field(
        default=False, description="Drop the autoscale policy: `replicas` is fixed again."
    )


class ScaleBody(_Request):
    replicas: int = Field(ge=0, le=10_000, description="The desired replica count.")


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
