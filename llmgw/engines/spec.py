"""What launching an engine needs: the profile, the shard spec and the facts about GPUs.

These are wire types: the control plane stores a `ShardSpec` as JSON in
Postgres and ships it to agents, so each is a frozen pydantic model that
round-trips through JSON unchanged and refuses fields it does not know (a typo
in a spec file must fail, not be dropped silently).

This module must NOT read files, the environment or anything else: parsing
input that came from elsewhere is `parse_shard_spec`'s job, given the data.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final, Literal, NewType

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmgw.errors import SpecError

__all__ = [
    "API_GENERATE",
    "API_GROUPS",
    "API_POOLING",
    "CPU_GPU_CLASS",
    "KV_HASH_ALGORITHM",
    "MAX_HASH_SEED",
    "TOKENIZER_NONE",
    "Adapter",
    "ApiGroup",
    "ExtraKeyFormat",
    "GPUInfo",
    "KVHashParams",
    "MultinodeBackend",
    "Profile",
    "ReplicaId",
    "ShardId",
    "ShardSpec",
    "apis_problem",
    "describe_validation_error",
    "hash_seed_problem",
    "is_valid_hash_seed",
    "parse_gpus",
    "parse_shard_spec",
    "tokenizer_problem",
]

# PYTHONHASHSEED's range: Python accepts "random" or an integer in [0, 2**32 - 1].
MAX_HASH_SEED = 2**32 - 1


def is_valid_hash_seed(seed: str) -> bool:
    """A seed Python accepts as PYTHONHASHSEED and llmgw accepts for KV hashing: 1..2**32-1,
    canonical decimal ("0" would also switch off Python's string-hash randomization)."""
    return hash_seed_problem(seed) is None


def hash_seed_problem(seed: str) -> str | None:
    """Why `seed` is no usable KV hash seed, or None when it is.

    The one rule for the seed, used by every entry point that takes one (the
    shard spec, the admin API, `llmgw kv hash`): Python refuses a
    PYTHONHASHSEED that is not a decimal integer up to 2**32-1 before the
    engine starts ("Fatal Python error: config_init_hash_seed"), "0" switches
    off string-hash randomization, and vLLM hashes the *string*, so "042" and
    "42" would seed Python alike but give different block hashes.
    """
    if (
        isinstance(seed, str)
        and seed.isascii()
        and seed.isdigit()
        and not seed.startswith("0")
        and int(seed) <= MAX_HASH_SEED
    ):
        return None
    # The value is not quoted: a file given by mistake may hold a secret there.
    return (
        "is not a usable PYTHONHASHSEED: it must be a decimal integer from 1 to "
        f"{MAX_HASH_SEED}, without leading zeros (Python refuses anything but an integer at "
        "start-up, so the engine would never run; 0 would switch off its string-hash "
        "randomization)"
    )


# A profile's ``tokenizer`` that says the model has no local tokenizer: its agents ship no
# files and the gateways never tokenize its prompts themselves.
TOKENIZER_NONE = "none"


def tokenizer_problem(value: str) -> str | None:
    """Why ``value`` cannot be a profile's ``tokenizer``, or None when it can.

    The one rule for the field, used by the admin API's schema and the launch spec alike: empty
    (the engine's own tokenizer), the keyword ``none``, or the absolute path of a directory on
    the node. The value is not quoted back: it is checked, not echoed.
    """
    if value in ("", TOKENIZER_NONE):
        return None
    if any(c in value for c in "\x00\n\r"):
        return (
            "must not hold a NUL character or a line break: give the absolute path of the "
            "directory holding tokenizer.json, e.g. /models/llama-3-8b-instruct"
        )
    if value.lower() == TOKENIZER_NONE:
        return f"the keyword is {TOKENIZER_NONE!r}, in lower case"
    if not value.startswith("/"):
        return (
            "must be the absolute path of a directory on the node holding tokenizer.json "
            "(e.g. /models/llama-3-8b-instruct), 'none' (the model has no local tokenizer: "
            "the gateways ask a replica's /tokenize), or empty (the engine's own tokenizer)"
        )
    return None


# The API families a model may serve (``Profile.apis``): `generate` (completions, chat,
# Responses, Anthropic Messages) and `pooling` (embeddings, rerank, score). A vLLM process
# serves one of them, by its runner (`--runner generate|pooling`); the gateways answer a
# request of a family the model's profiles do not serve with a 404 naming what it does serve.
ApiGroup = Literal["generate", "pooling"]
API_GENERATE: Final = "generate"
API_POOLING: Final = "pooling"
API_GROUPS: Final[tuple[ApiGroup, ...]] = (API_GENERATE, API_POOLING)


def apis_problem(values: Sequence[str]) -> str | None:
    """Why ``values`` cannot be a profile's ``apis``, or None when they can.

    The one rule for the field, used by the admin API's schema and the launch spec alike:
    each value one of API_GROUPS, each at most once (empty: the engine's default). A value
    outside the set is not quoted back whole (it is checked, not echoed)."""
    seen: set[str] = set()
    for value in values:
        if value not in API_GROUPS:
            return (
                f"{value[:32]!r} is no API family: each must be one of "
                f"{', '.join(API_GROUPS)} (or leave the list empty for the engine's default)"
            )
        if value in seen:
            return f"lists {value!r} twice: give each API family once"
        seen.add(value)
    return None


ReplicaId = NewType("ReplicaId", str)
ShardId = NewType("ShardId", str)

# The gpu_class of a profile that runs on CPU cores alone. Placement gives its
# shards threads instead of GPUs, and adapters hide every GPU from them.
CPU_GPU_CLASS = "cpu"

# The only block-hash algorithm llmgw's router reproduces (docs/architecture.md §7): vLLM's
# default `sha256` pickles, which no other process can hash identically.
KV_HASH_ALGORITHM: Literal["sha256_cbor"] = "sha256_cbor"

# How LoRA names and cache salts enter vLLM's block-hash extra keys: "tagged"
# since vLLM 0.31, "legacy" for 0.19-0.30. A property of the engine build that
# the router must match; the simulator takes it as a flag.
ExtraKeyFormat = Literal["tagged", "legacy"]

# How a multi-node vLLM replica is wired: Ray (docs/architecture.md §6's default) or vLLM's
# own multiprocess launcher (`--nnodes/--headless`). Other engines ignore it.
MultinodeBackend = Literal["ray", "native"]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class Adapter(_Wire):
    """A LoRA adapter loaded beside the model. Path is a source until the agent
    has fetched it, a local file after."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)


class KVHashParams(_Wire):
    """The parameters the router needs to hash prompts exactly as the engine
    hashes its KV blocks (docs/architecture.md §3). Replicas whose parameters differ never
    share a block hash, so the router groups replicas by this value."""

    # Becomes PYTHONHASHSEED, which seeds vLLM's root hash (NONE_HASH). Empty
    # means "not chosen": a kv_events profile is refused until the control plane
    # fills in its per-cluster random seed. "0" is refused too, since it also
    # turns off Python's string-hash randomization in the engine process.
    # Python itself reads the variable too, and a value that is not a decimal
    # integer up to 2**32-1 kills the interpreter before vLLM starts ("Fatal
    # Python error: config_init_hash_seed"). vLLM hashes the *string*, so it is
    # kept canonical (no sign, no leading zeros): "042" and "42" would seed
    # Python alike but give different block hashes.
    seed: str = ""
    block_size: int = Field(default=16, gt=0)
    algorithm: Literal["sha256_cbor"] = KV_HASH_ALGORITHM
    extra_key_format: ExtraKeyFormat = "tagged"

    @field_validator("seed")
    @classmethod
    def _python_accepts_it(cls, v: str) -> str:
        problem = hash_seed_problem(v) if v else None
        if problem is not None:
            raise ValueError(f"kv_hash.seed {problem}")
        return v


# The admin API's flat KV hash fields, by the KVHashParams field each is.
_ADMIN_KV_FIELDS = {
    "kv_hash_seed": "seed",
    "kv_block_size": "block_size",
    "kv_hash_algo": "algorithm",
    "kv_extra_key_format": "extra_key_format",
}
# What the admin API adds to a profile that no launch reads.
_ADMIN_READ_ONLY = frozenset(
    {"id", "version", "fingerprint", "created_at", "updated_at", "description", "secret_env_keys"}
)


# Names operators also write for an engine, and the one llmgw stores: llama.cpp is what the
# project calls itself. Applied on the way in, so a fingerprint never sees the alias.
ENGINE_ALIASES = {"llama.cpp": "llamacpp"}


def canonical_engine(name: str) -> str:
    return ENGINE_ALIASES.get(name, name)


class Profile(_Wire):
    """How a model runs on a GPU class, reduced to what launching needs."""

    name: str = Field(min_length=1)
    engine: str = Field(min_length=1)
    gpu_class: str = ""
    # Tensor and pipeline parallel degrees.
    tp: int = 1
    pp: int = 1
    # GPUs each shard occupies; 0 means tp x pp (one node holds the replica).
    gpus_per_node: int = 0
    # Nodes one replica spans. Above 1, a fabric is required.
    nodes: int = 1
    # Passed to the engine untouched, in order, after the flags the adapter sets.
    args: tuple[str, ...] = ()
    # Override what the adapter generates: the escape hatch for per-cluster
    # tuning no adapter can guess. Unsafe names are refused (see env.py).
    env: dict[str, str] = Field(default_factory=dict)
    # Environment variable name -> reference to a secret. The control plane
    # resolves the references into ShardSpec.secret_env; the references are
    # write-only for admins and never part of a fingerprint.
    secret_env: dict[str, str] = Field(default_factory=dict, repr=False)
    model_path: str = ""
    # The model's name in the catalog: what clients send as "model", so what
    # the engine answers to unless served_model_name says otherwise.
    model: str = ""
    # The name clients use; empty means the model's name (the admin API's
    # meaning), and only a spec that names no model falls back to the path.
    served_model_name: str = ""
    # In order: an adapter's index is the id llama.cpp applies it by.
    adapters: tuple[Adapter, ...] = ()
    # Runtime LoRA adapters (`kind: adapter` documents) the engine holds loaded at once: the
    # leader places at most this many on each replica and the agent loads and unloads them
    # in the running engine. 0: none, the engine serves only `adapters` above. Above 0 only
    # for an engine that loads adapters at runtime (Engine.runtime_adapters); the flags it
    # adds (vLLM's --enable-lora --max-cpu-loras and runtime updating) are part of the
    # fingerprint, the adapters placed are not.
    adapter_slots: int = Field(default=0, ge=0, le=1024)
    # Have the engine publish KV cache events to the agent (vLLM and sim only).
    kv_events: bool = False
    # CPU cores an engine on the CPU computes on; 0 leaves it to placement
    # (ShardSpec.threads) or the engine.
    threads: int = Field(default=0, ge=0)
    kv_hash: KVHashParams = Field(default_factory=KVHashParams)
    multinode_backend: MultinodeBackend = "ray"
    # The gateway's admission ceiling per replica (requests running plus waiting, all
    # gateways); 0: the engine's default (engines/admission.py). Not part of the fingerprint:
    # it changes what is sent to the process, not the process.
    max_in_flight: int = Field(default=0, ge=0, le=1_000_000)
    # Where the gateways' copy of the model's tokenizer comes from: "" the engine's own
    # (Engine.tokenizer_dir: its --tokenizer, else model_path), "none" no local tokenizer at all,
    # else the directory on the node whose files the agent ships (tokenizer_problem). Not part
    # of the fingerprint: it changes what the agent ships beside the process, not the process.
    tokenizer: str = ""
    # The API families the model serves (API_GROUPS); empty: the engine's default for the
    # profile (Engine.served_apis: vLLM's from its --runner, the simulator both). Read live by
    # the gateways' route table. Not part of the fingerprint: it changes which requests the
    # gateways send the process, not the process.
    apis: tuple[ApiGroup, ...] = ()

    @field_validator("engine")
    @classmethod
    def _canonical_engine(cls, v: str) -> str:
        return canonical_engine(v)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_ok(cls, v: str) -> str:
        problem = tokenizer_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("apis")
    @classmethod
    def _apis_ok(cls, v: tuple[ApiGroup, ...]) -> tuple[ApiGroup, ...]:
        problem = apis_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="before")
    @classmethod
    def _admin_api_document(cls, data: Any) -> Any:
        """Accept a profile as the admin API returns it, so one can be pasted into a spec.

        The API stores the KV hash parameters flat (kv_hash_seed, ...) and adds
        read-only fields; a typo still fails, as every other unknown key does.
        """
        if not isinstance(data, dict):
            return data
        flat = {k: data[k] for k in _ADMIN_KV_FIELDS if k in data}
        if not flat and not any(k in data for k in _ADMIN_READ_ONLY):
            return data
        out = {
            k: v for k, v in data.items() if k not in _ADMIN_KV_FIELDS and k not in _ADMIN_READ_ONLY
        }
        if flat:
            if "kv_hash" in data:
                raise ValueError(
                    f"give the KV hash parameters once: kv_hash or the admin API's "
                    f"{', '.join(sorted(flat))}, not both"
                )
            out["kv_hash"] = {_ADMIN_KV_FIELDS[k]: v for k, v in flat.items()}
        keys = data.get("secret_env_keys")
        if isinstance(keys, list) and "secret_env" not in data:
            # Names only (references are write-only): they still count, as
            # the process gets these variables.
            out["secret_env"] = {str(k): "" for k in keys}
        return out

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model or self.model_path

    @property
    def pp_degree(self) -> int:
        return max(self.pp, 1)

    @property
    def num_nodes(self) -> int:
        return max(self.nodes, 1)

    @property
    def per_node(self) -> int:
        """GPUs each shard holds."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.tp * self.pp_degree

    @property
    def cpu_only(self) -> bool:
        return self.gpu_class == CPU_GPU_CLASS


class ShardSpec(_Wire):
    """One shard of one replica on one node: the full launch spec.

    The control plane fills in placement (GPUs, HCAs, fabric, leader port);
    the agent fills in what only the node knows (bind and node addresses, the
    HTTP and KV-event ports, UUIDs of MIG instances, its runtime directory).
    """

    replica_id: ReplicaId
    shard_id: ShardId
    # Node rank; 0 is the leader and the only rank that serves HTTP.
    rank: int = Field(default=0, ge=0)
    nnodes: int = Field(default=1, ge=1)
    # The distributed-init endpoint, always on the management network rather
    # than the fabric: NCCL bootstraps over TCP and only then moves to RDMA.
    # Under Ray it is the Ray head's GCS port.
    leader_addr: str = ""
    leader_port: int = Field(default=0, ge=0, le=65535)
    # The local GPUs this shard uses, nvidia-smi's (PCI bus) numbering.
    gpu_indices: tuple[int, ...] = ()
    # The same devices by UUID, in the same order, set by the agent only when
    # one is a MIG instance: CUDA addresses an instance only as
    # CUDA_VISIBLE_DEVICES=MIG-<uuid>, and the indices placement uses for it
    # (1000 and up) mean nothing to CUDA.
    gpu_uuids: tuple[str, ...] = ()
    # The adapters of the chosen fabric, and only that fabric: NCCL given HCAs
    # of a fabric the peer is not on hangs instead of failing.
    hcas: tuple[str, ...] = ()
    # The ethernet interface bootstrap traffic uses.
    mgmt_interface: str = ""
    # RoCE v2 GID index of the HCAs, set by the agent for RoCE; None on
    # InfiniBand, where NCCL needs none.
    gid_index: int | None = None
    http_port: int = Field(default=0, ge=0, le=65535)
    profile: Profile
    # Where the engine's HTTP server listens, set by the agent. Empty means
    # 127.0.0.1: engines are no security boundary (docs/architecture.md §6), so they are
    # reached through the agent's authenticating proxy unless the operator
    # declared the management network trusted.
    bind_addr: str = ""
    # This node's management address, set by the agent: what peers reach this
    # rank on (VLLM_HOST_IP, Ray's --node-ip-address). Needed off the leader.
    node_addr: str = ""
    # The management addresses of every rank's node, by rank. Only launchers
    # that start all ranks from the leader (TensorRT-LLM's mpirun) read it.
    peer_addrs: tuple[str, ...] = ()
    # What the engine demands of every request. Given in the environment or a
    # 0600 file, never argv, which every user on the node can read.
    api_key: str = Field(default="", repr=False)
    # Resolved Profile.secret_env: variable name -> secret value.
    secret_env: dict[str, str] = Field(default_factory=dict, repr=False)
    # Loopback port the agent receives this shard's KV events on (its SUB
    # binds, the engine's PUB connects); 0 when it publishes none. Kept in the
    # spec so a restarted agent listens where an adopted engine still sends.
    kv_events_port: int = Field(default=0, ge=0, le=65535)
    # Loopback port the engine binds its replay ROUTER on; 0 for no replay.
    kv_replay_port: int = Field(default=0, ge=0, le=65535)
    # CPU cores placement reserved for a shard with no GPU; 0 leaves it to the
    # profile's threads or the engine.
    threads: int = Field(default=0, ge=0)
    # Which cores (logical CPU ids, as the kernel numbers them) a CPU shard computes on, set by
    # the agent at start: placement reserves a count per node, and the agent picks that many
    # of the CPUs it may run on that its other CPU shards do not hold. Kept in the record, so a
    # restarted agent that adopts the engine keeps them and gives them to no other shard.
    # Empty: not chosen (a spec built without an agent), and the engine binds no cores.
    cpu_cores: tuple[int, ...] = ()
    # Directory the agent writes this shard's files into (Command.files);
    # empty means the directory the shard is started in.
    runtime_dir: str = ""
    # Control-plane facts carried so the agent can report them back after a
    # restart. Fabric's "nvl:" prefix also marks a multi-node NVLink domain,
    # which changes NCCL's environment.
    pool: str = ""
    fabric: str = ""
    # The fingerprint of the profile version this shard was started from;
    # carried, never read here.
    profile_fp: str = ""

    @field_validator("cpu_cores")
    @classmethod
    def _cores_are_cpu_ids(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(c < 0 for c in v) or len(set(v)) != len(v):
            raise ValueError("cpu_cores must list distinct CPU ids, each 0 or more")
        return v

    @model_validator(mode="after")
    def _uuids_name_the_indices(self) -> ShardSpec:
        if self.gpu_uuids and len(self.gpu_uuids) != len(self.gpu_indices):
            raise ValueError(
                f"gpu_uuids names {len(self.gpu_uuids)} devices but gpu_indices "
                f"{len(self.gpu_indices)}; they are the same devices in the same order"
            )
        return self

    @property
    def host(self) -> str:
        return self.bind_addr or "127.0.0.1"

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def on_mig(self) -> bool:
        return any(u.startswith("MIG-") for u in self.gpu_uuids)

    @property
    def num_threads(self) -> int:
        return self.threads or self.profile.threads

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_uuids) if self.gpu_uuids else len(self.gpu_indices)


class GPUInfo(_Wire):
    """The facts about one GPU that validation needs."""

    index: int
    name: str
    # As NVML reports it, "9.0"; unparsable values skip capability checks.
    compute_capability: str = ""
    memory_total_mb: int = 0

    @property
    def mig(self) -> bool:
        # NVML names an instance "<parent> MIG 1g.10gb", and placement numbers
        # instances from 1000 (seed), so either mark means a slice.
        return self.index >= 1000 or " MIG " in f" {self.name} "


_PRINTABLE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def _loc_part(part: object) -> str:
    # A key of the document is content: a file given by mistake (a password
    # file read as YAML) turns its lines into keys. Field-name-like keys are
    # named; anything else is not echoed.
    if isinstance(part, int) or (isinstance(part, str) and _PRINTABLE_KEY.fullmatch(part)):
        return str(part)
    return "<key not shown>"


def describe_validation_error(what: str, err: ValidationError) -> str:
    """One line per problem, each naming the field path (never the value), for people."""
    parts = []
    for e in err.errors():
        loc = ".".join(_loc_part(p) for p in e["loc"]) or "(top level)"
        parts.append(f"{loc}: {e['msg']}")
    return f"{what} is invalid: " + "; ".join(parts)


def parse_shard_spec(data: Any) -> ShardSpec:
    """A ShardSpec from decoded JSON or YAML, or a SpecError naming each bad field."""
    try:
        return ShardSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(describe_validation_error("shard spec", e), field="spec") from None


def parse_gpus(data: Any) -> list[GPUInfo]:
    """A GPU list (JSON list of GPUInfo objects), or a SpecError."""
    if not isinstance(data, list):
        raise SpecError(
            f"GPU list must be a JSON list of objects, got {type(data).__name__}", field="gpus"
        )
    try:
        return [GPUInfo.model_validate(g) for g in data]
    except ValidationError as e:
        raise SpecError(describe_validation_error("GPU list", e), field="gpus") from None
