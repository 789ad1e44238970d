"""Request and response bodies of the admin API's profiles: an engine, its parallelism and
placement, its command line and environment (secret references write-only), adapters, the KV
settings, the tokenizer the gateways use and the API families they send the model. The shared
bounds and bases: ``schemas``."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
)

from llmgw.controlplane.admin.schemas import (
    INT32_MAX,
    LIMITS,
    Description,
    Name,
    _Request,
    _Response,
)
from llmgw.engines import (
    MAX_HASH_SEED,
    ApiGroup,
    apis_problem,
    canonical_engine,
    is_valid_hash_seed,
    tokenizer_problem,
)

__all__ = [
    "MAX_ADAPTER_SLOTS",
    "AdapterBody",
    "AdapterPath",
    "MultinodeBackend",
    "ProfileCreate",
    "ProfileOut",
    "ProfileUpdate",
]

EnvName = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=LIMITS["env_name_chars"]),
]
EnvValue = Annotated[str, StringConstraints(max_length=LIMITS["env_value_chars"])]
SecretRef = Annotated[str, StringConstraints(max_length=LIMITS["secret_ref_chars"])]
Arg = Annotated[str, StringConstraints(max_length=LIMITS["arg_chars"])]
Path_ = Annotated[str, StringConstraints(min_length=1, max_length=LIMITS["path_chars"])]
ShortText = Annotated[str, StringConstraints(max_length=LIMITS["short_text_chars"])]
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


def _apis_ok(value: list[ApiGroup]) -> list[ApiGroup]:
    problem = apis_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


# A profile's API families: each one of llmgw.engines.API_GROUPS (a value outside them is a 422
# naming the field and the values it takes), each once (llmgw.engines.apis_problem, which also
# ends a long list at its first repeat).
Apis = Annotated[list[ApiGroup], AfterValidator(_apis_ok)]
_APIS_DOC = (
    "The API families the model serves, each once: `generate` (completions, chat completions, "
    "Responses, Anthropic Messages) and `pooling` (embeddings, rerank, score). The gateways "
    "answer a request of a family no profile serving the model lists with a 404 naming the "
    "routes it does serve; an adapter serves its base model's. Empty: the engine's default for "
    "the profile: vLLM serves `pooling` where its args choose the pooling runner (`--runner "
    "pooling`, or a `--convert` of embed or classify) and `generate` otherwise (vLLM's `--runner "
    "auto` picks by the model's architecture, which llmgw does not read: list `pooling` for an "
    "embedding model run without `--runner pooling`); the simulator serves both; every other "
    "engine `generate`. The engine's command line does not change. Not in the fingerprint: "
    "editing it rolls nothing, the gateways apply it within seconds."
)

# How a multi-node vLLM replica is wired (llmgw.engines.MultinodeBackend); the table's CHECK
# holds the same two values.
MultinodeBackend = Literal["ray", "native"]


# Parallelism beyond this is a typo, not a cluster; it also keeps every count inside Postgres'
# 32-bit integer columns, so a huge number is a 422 naming the field, not a database error.
_MAX_PARALLEL = 65_536


# Where a LoRA adapter comes from, a profile's static one and a declared one (``kind: adapter``)
# alike: a directory on the nodes or an http(s) source (`...#sha256=<hex>` pins its content).
# The control plane refuses only what no node could use (empty, past 4096 characters, a NUL);
# each node's agent decides the rest against its own policy (agent.policy.
# allowed_adapter_sources, else allowed_model_roots) before it starts anything.
AdapterPath = Path_


# Runtime adapters one engine holds loaded at once, at most: the bound of engines.Profile's
# field, of the table's CHECK and of a shard's adapters on the agent protocol.
MAX_ADAPTER_SLOTS = 1024
_ADAPTER_SLOTS_DOC = (
    "Runtime LoRA adapters (`kind: adapter` documents) each replica's engine holds loaded at "
    "once: the leader places at most this many on a replica and its agent loads and unloads "
    "them in the running engine, by demand. 0: none; the engine serves only `adapters` above. "
    "Above 0 only for engines that load adapters at runtime (vLLM, SGLang and the "
    "simulator); the engine's flags it adds are in the fingerprint, so changing it rolls the "
    "profile's replicas, while the adapters placed never do."
)


class AdapterBody(_Request):
    name: Name
    path: AdapterPath


class _ProfileFields(_Request):
    engine: Engine
    gpu_class: ShortText = ""
    tp: StrictInt = Field(default=1, ge=1, le=_MAX_PARALLEL, description="Tensor-parallel degree.")
    pp: StrictInt = Field(
        default=1, ge=1, le=_MAX_PARALLEL, description="Pipeline-parallel degree."
    )
    gpus_per_node: StrictInt = Field(
        default=0, ge=0, le=_MAX_PARALLEL, description="0: tp x pp on one node."
    )
    nodes: StrictInt = Field(default=1, ge=1, le=_MAX_PARALLEL)
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
    kv_events: StrictBool = False
    adapter_slots: StrictInt = Field(
        default=0, ge=0, le=MAX_ADAPTER_SLOTS, description=_ADAPTER_SLOTS_DOC
    )
    threads: StrictInt = Field(
        default=0,
        ge=0,
        le=_MAX_PARALLEL,
        description="CPU threads of a CPU-only shard (gpu_class `cpu`), reserved on its node by "
        "placement; 0: one. llama.cpp: its --threads. vLLM (a CPU build): its OpenMP threads, "
        "each bound to one of as many cores the node's agent picks for the shard and keeps for "
        "its life (VLLM_CPU_OMP_THREADS_BIND, OMP_NUM_THREADS). A vLLM CPU profile sizes its "
        "KV cache with the env VLLM_CPU_KVCACHE_SPACE (whole GiB; 1 when unset), needs a KV "
        "block size that is a multiple of 32 (kv_block_size with kv_events, else any "
        "--block-size), refuses --enable-sleep-mode (CUDA-only: the autoscaler stops an idle "
        "CPU replica instead of suspending it), and its model's attention heads need 32 "
        "dimensions or more (checked by the agent from config.json).",
    )
    kv_hash_seed: str | None = Field(
        default=None,
        description="PYTHONHASHSEED of the engines: an integer 1..4294967295 as a string. "
        "None: the cluster's random seed.",
    )
    kv_block_size: StrictInt = Field(default=16, ge=1, le=4096)
    kv_hash_algo: Literal["sha256_cbor"] = "sha256_cbor"
    kv_extra_key_format: Literal["tagged", "legacy"] = "tagged"
    multinode_backend: MultinodeBackend = Field(
        default="ray",
        description="How a replica spanning nodes is wired: a Ray cluster, or the engine's own "
        "multi-node launch (vLLM's --nnodes/--node-rank). Ignored on one node.",
    )
    max_in_flight: StrictInt = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Requests (running plus waiting) the gateways send one replica at most; "
        "the rest wait in the gateway's fair queue. 0: the engine's default, its batch limit "
        "(vLLM --max-num-seqs, ...) plus half of it waiting. Not in the fingerprint: editing "
        "it rolls nothing, the gateways apply it within seconds.",
    )
    tokenizer: Tokenizer = Field(default="", description=_TOKENIZER_DOC)
    apis: Apis = Field(default_factory=list, description=_APIS_DOC)
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
    version: StrictInt = Field(
        ge=1, le=INT32_MAX, description="The version you read; a stale one gets 409."
    )
    engine: Engine | None = None
    gpu_class: ShortText | None = None
    tp: StrictInt | None = Field(default=None, ge=1, le=_MAX_PARALLEL)
    pp: StrictInt | None = Field(default=None, ge=1, le=_MAX_PARALLEL)
    gpus_per_node: StrictInt | None = Field(default=None, ge=0, le=_MAX_PARALLEL)
    nodes: StrictInt | None = Field(default=None, ge=1, le=_MAX_PARALLEL)
    model_path: Path_ | None = None
    served_model_name: ShortText | None = None
    args: list[Arg] | None = Field(default=None, max_length=LIMITS["args_items"])
    env: dict[EnvName, EnvValue] | None = Field(default=None, max_length=LIMITS["env_items"])
    secret_env: dict[EnvName, SecretRef] | None = Field(
        default=None, max_length=LIMITS["env_items"]
    )
    adapters: list[AdapterBody] | None = Field(default=None, max_length=LIMITS["adapters_items"])
    kv_events: StrictBool | None = None
    adapter_slots: StrictInt | None = Field(default=None, ge=0, le=MAX_ADAPTER_SLOTS)
    threads: StrictInt | None = Field(default=None, ge=0, le=_MAX_PARALLEL)
    kv_hash_seed: str | None = None
    kv_block_size: StrictInt | None = Field(default=None, ge=1, le=4096)
    kv_hash_algo: Literal["sha256_cbor"] | None = None
    kv_extra_key_format: Literal["tagged", "legacy"] | None = None
    multinode_backend: MultinodeBackend | None = None
    max_in_flight: StrictInt | None = Field(default=None, ge=0, le=1_000_000)
    tokenizer: Tokenizer | None = None
    apis: Apis | None = None
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
    adapter_slots: int
    threads: int
    kv_hash_seed: str
    kv_block_size: int
    kv_hash_algo: str
    kv_extra_key_format: str
    multinode_backend: str
    max_in_flight: int
    tokenizer: str
    apis: list[str] = Field(
        description="As stored; empty: the engine's default (see the create body's `apis`)."
    )
    description: str
    fingerprint: str
    version: int
    created_at: datetime
    updated_at: datetime
