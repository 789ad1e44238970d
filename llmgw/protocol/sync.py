"""Registration and declarative sync between a node agent and the control plane (docs/architecture.md §5).

HTTP + JSON on the control plane's internal listener:

    POST REGISTER_PATH  RegisterRequest  -> RegisterResponse   (bootstrap token in the body)
    POST SYNC_PATH      SyncRequest      -> SyncResponse       (Authorization: Bearer <node credential>)

Errors answer with a non-2xx status and a `ProtocolErrorBody`: 401 for a
missing, wrong or revoked credential or token, 409 for a node id that is not
the credential's, 426 for a protocol version the server does not speak.

Version skew is the rule, not the exception: agents and control planes are
upgraded one at a time, so every model IGNORES fields it does not know (an
older agent keeps working against a newer control plane) and new fields get
defaults. Every string and list is bounded, because both sides parse bodies
from the network before trusting them. A shard's launch spec travels as a
JSON object, not as `llmgw.engines.ShardSpec`: that model refuses unknown
fields, and one spec an older agent cannot parse must fail that shard only
(the agent reports it), never the whole sync.

Secrets: `RegisterRequest.bootstrap_token`, `RegisterResponse.node_credential`
and `DesiredShard.engine_api_key` are excluded from `repr` so a logged model
never shows them; nothing else in this module carries one. A profile's
`secret_env` carries references (`env:NAME`, `file:/path`) that only the node
resolves.

This module must NOT import llmgw.nodeagent or llmgw.controlplane, do I/O or
read the environment.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from llmgw.protocol.names import name_problem

__all__ = [
    "KV_PATH",
    "MAX_BINDINGS",
    "MAX_INSTANCES",
    "MAX_LOG_TAIL_CHARS",
    "MAX_REASON_CHARS",
    "MAX_RUNTIME_ADAPTERS",
    "MAX_SHARDS",
    "PROTOCOL_VERSION",
    "REGISTER_PATH",
    "SYNC_PATH",
    "AdapterObserved",
    "AdapterState",
    "ApprovalState",
    "ControlPlaneInstance",
    "DesiredShard",
    "DesiredState",
    "FabricInfo",
    "GpuDevice",
    "InstalledEngine",
    "NodeInventory",
    "ObservedState",
    "ProtocolErrorBody",
    "RegisterRequest",
    "RegisterResponse",
    "RuntimeAdapter",
    "ShardBinding",
    "SyncRequest",
    "SyncResponse",
]

# Bumped only for a change an older peer cannot ignore; additive changes
# (a new optional field) keep it, since unknown fields are ignored.
PROTOCOL_VERSION = 1

REGISTER_PATH = "/agent/v1/register"
SYNC_PATH = "/agent/v1/sync"
# The KV-delta stream (llmgw.protocol.kvstream).
KV_PATH = "/agent/v1/kv"

# Bounds. Sized for the largest node llmgw plans for (8 GPUs x 7 MIG instances, a
# few shards each) with room to spare; a peer sending more is broken or
# hostile, and the body is refused rather than allocated.
MAX_SHARDS = 256
MAX_BINDINGS = MAX_SHARDS
MAX_GPUS = 128
MAX_FABRICS = 32
MAX_ENGINES = 32
MAX_INSTANCES = 64
MAX_NAME_CHARS = 253  # a DNS name: node names, ids, model names
MAX_ID_CHARS = 128
MAX_TOKEN_CHARS = 4096
MAX_URL_CHARS = 2048
MAX_REASON_CHARS = 2048
# The last lines of a failed engine's log: enough to show a Python traceback
# or a CUDA error, small enough that 256 failing shards stay one request.
MAX_LOG_TAIL_CHARS = 8192
MAX_VERSION_CHARS = 256
# LoRA adapters one engine holds loaded at runtime: vLLM's --max-cpu-loras and SGLang's
# --max-loaded-loras are in the tens to hundreds on a large GPU.
MAX_RUNTIME_ADAPTERS = 1024

ApprovalState = Literal["pending", "approved"]
DesiredState = Literal["running", "suspended", "stopped"]
# starting: launched, health not yet 200. ready: serving. unhealthy: was ready
# or is past its start deadline and does not answer. draining: being stopped.
# exited: its process ended and a restart is scheduled. failed: the agent will
# not (or cannot yet) run it: a crash loop, a refused spec, an unreadable
# state record; `reason` says which.
ObservedState = Literal["starting", "ready", "unhealthy", "draining", "exited", "failed"]
# A runtime adapter on a shard's engine, as its agent sees it. loading: the engine's load call
# is under way; loaded: it answered success (requests for it may be sent); failed: the last
# load failed, `reason` is the engine's (or the node policy's) answer and the agent retries
# with backoff; unloading: the engine's unload call is under way.
AdapterState = Literal["loading", "loaded", "failed", "unloading"]

_Name = Field(min_length=1, max_length=MAX_NAME_CHARS)


def _node_name_ok(name: str) -> str:
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(f"{problem}; set the agent's node_name (LLMGW_AGENT__NODE_NAME)")
    return name


# A node's name is addressed as /admin/v1/nodes/{name} and printed by `llmgw status`: the one
# name rule of every object (llmgw.protocol.names), so a newline or an escape sequence never
# reaches a URL or a terminal.
NodeName = Annotated[
    str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_node_name_ok)
]


class _Wire(BaseModel):
    # extra="ignore": see the module docstring (version skew).
    model_config = ConfigDict(extra="ignore", frozen=True)


class ProtocolErrorBody(_Wire):
    """The body of every non-2xx answer: a stable code and a message for people."""

    code: str = Field(max_length=64)
    message: str = Field(max_length=MAX_REASON_CHARS)


# --- inventory -----------------------------------------------------------------


class GpuDevice(_Wire):
    """One GPU, or one MIG instance of a GPU, as the agent discovered it."""

    # nvidia-smi's (PCI bus order) index. MIG instances are numbered from
    # 1000 up (1000 + parent index * 100 + NVML MIG slot) since CUDA gives them
    # no index; placement uses these numbers, and the agent turns them into
    # MIG-<uuid> at launch.
    index: int = Field(ge=0, le=1_000_000)
    uuid: str = Field(default="", max_length=MAX_ID_CHARS)
    name: str = Field(max_length=MAX_NAME_CHARS)
    # What profiles name (`gpu_class`): NVML's name for a GPU, "<parent> MIG
    # <profile>" for an instance, "sim" for a simulated GPU, on which only the
    # `sim` engine is placed.
    gpu_class: str = Field(max_length=MAX_NAME_CHARS)
    memory_total_mb: int = Field(default=0, ge=0)
    # "9.0"; empty when unknown.
    compute_capability: str = Field(default="", max_length=16)
    # Set on a MIG instance: the UUID of the GPU it is carved from. A GPU
    # with MIG enabled is listed too, with mig_enabled, and is not placeable.
    mig_parent_uuid: str = Field(default="", max_length=MAX_ID_CHARS)
    mig_enabled: bool = False
    # Error counters since boot: XID events seen by the agent and volatile
    # uncorrected ECC errors. A rising count is why a node gets cordoned.
    xid_errors: int = Field(default=0, ge=0)
    ecc_uncorrected: int = Field(default=0, ge=0)
    simulated: bool = False


class FabricInfo(_Wire):
    """A fabric the node is on: configured by the operator, checked by the agent."""

    name: str = _Name
    # ib: InfiniBand; roce: RDMA over Ethernet (needs a GID index); nvl: a
    # multi-node NVLink domain (name "nvl:<domain>").
    kind: Literal["ib", "roce", "nvl"]
    hcas: tuple[str, ...] = Field(default=(), max_length=64)
    gid_index: int | None = Field(default=None, ge=0, le=1024)
    # False when an HCA the config names is missing from /sys/class/infiniband:
    # the control plane must not place a multi-node replica on it.
    present: bool = True
    problem: str = Field(default="", max_length=MAX_REASON_CHARS)


class InstalledEngine(_Wire):
    """An engine this node offers (or has disabled), and what the agent found of it."""

    name: str = Field(max_length=64)
    path: str = Field(default="", max_length=MAX_URL_CHARS)
    version: str = Field(default="", max_length=MAX_VERSION_CHARS)
    disabled: bool = False


class NodeInventory(_Wire):
    """What the node has. Sent on registration and on a sync only when it changed."""

    gpus: tuple[GpuDevice, ...] = Field(default=(), max_length=MAX_GPUS)
    fabrics: tuple[FabricInfo, ...] = Field(default=(), max_length=MAX_FABRICS)
    # Logical CPUs placement may give to CPU engines.
    cpu_threads: int = Field(default=0, ge=0)
    memory_total_mb: int = Field(default=0, ge=0)
    engines: tuple[InstalledEngine, ...] = Field(default=(), max_length=MAX_ENGINES)
    # Where the inventory came from: nvml, file or sim.
    source: str = Field(default="", max_length=32)


# --- registration --------------------------------------------------------------


class RegisterRequest(_Wire):
    protocol_version: int = PROTOCOL_VERSION
    bootstrap_token: str = Field(min_length=1, max_length=MAX_TOKEN_CHARS, repr=False)
    node_name: NodeName
    # The address the control plane and peers reach this node on (the
    # shards' front doors, Ray, NCCL bootstrap).
    mgmt_addr: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    inventory: NodeInventory
    agent_version: str = Field(default="", max_length=MAX_VERSION_CHARS)


class RegisterResponse(_Wire):
    node_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    node_credential: str = Field(min_length=1, max_length=MAX_TOKEN_CHARS, repr=False)
    cluster_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    approval_state: ApprovalState


# --- sync ----------------------------------------------------------------------


class ShardBinding(_Wire):
    """What the agent observes of one shard; sent for every shard it knows, every sync."""

    shard_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    observed_state: ObservedState
    # Why the state is not the desired one: empty when it is.
    reason: str = Field(default="", max_length=MAX_REASON_CHARS)
    # The engine's pid (the shard's last command; the wrapper's while none runs).
    pid: int | None = Field(default=None, ge=1)
    # With pid and process_start_time, what proves after an agent restart that
    # the process is the one started (a pid alone is reused).
    boot_id: str = Field(default="", max_length=64)
    # /proc/<pid>/stat field 22: clock ticks after boot.
    process_start_time: int | None = Field(default=None, ge=0)
    http_port: int = Field(default=0, ge=0, le=65535)
    kv_events_port: int = Field(default=0, ge=0, le=65535)
    kv_replay_port: int = Field(default=0, ge=0, le=65535)
    # Where the gateway reaches this shard: its front door, the authenticating proxy its
    # wrapper serves, http://<mgmt_addr>:<port>/shards/<shard_id>. Empty until it is ready.
    proxy_url: str = Field(default="", max_length=MAX_URL_CHARS)
    engine_version: str = Field(default="", max_length=MAX_VERSION_CHARS)
    # The fingerprint of the desired shard the running process was started
    # from, so the control plane sees a rollout land without guessing.
    fingerprint: str = Field(default="", max_length=MAX_ID_CHARS)
    # Restarts after crashes since the agent first started this spec.
    restarts: int = Field(default=0, ge=0)
    exit_code: int | None = None
    # Unix seconds the current process started.
    started_at: float | None = None
    # The end of the engine's log, only when failed.
    log_tail: str = Field(default="", max_length=MAX_LOG_TAIL_CHARS)
    # The runtime adapters of the engine (rank 0 only): every one desired or still held,
    # with its state. Empty for engines that load none at runtime.
    adapters: tuple[AdapterObserved, ...] = Field(default=(), max_length=MAX_RUNTIME_ADAPTERS)


class AdapterObserved(_Wire):
    """One runtime LoRA adapter on a shard's engine, as the agent reports it."""

    name: str = _Name
    state: AdapterState
    reason: str = Field(default="", max_length=MAX_REASON_CHARS)
    # Failed loads in a row (reset by a success): what the agent's backoff counts.
    failures: int = Field(default=0, ge=0)


class SyncRequest(_Wire):
    protocol_version: int = PROTOCOL_VERSION
    node_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    # New on every agent start and never smaller than the last one: with seq,
    # orders reports so a delayed request of a previous agent run never
    # overwrites a newer one ((epoch, seq) must grow).
    agent_epoch: int = Field(ge=0)
    seq: int = Field(ge=0)
    # The desired_version the agent last applied; None on its first sync.
    desired_version: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    bindings: tuple[ShardBinding, ...] = Field(default=(), max_length=MAX_BINDINGS)
    # Only when it changed since the last sync the control plane answered.
    inventory: NodeInventory | None = None


class ControlPlaneInstance(_Wire):
    """A live control plane process: every one gets the node's KV deltas."""

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    internal_url: str = Field(min_length=1, max_length=MAX_URL_CHARS)


class RuntimeAdapter(_Wire):
    """A LoRA adapter the leader placed on a replica (a `kind: adapter` document): what the
    agent loads into the running engine without a restart."""

    name: str = _Name
    # A directory on the node (under agent.policy.allowed_model_roots when that is set) or
    # an http(s) source the agent fetches first, as a profile's adapters take it.
    path: str = Field(min_length=1, max_length=MAX_URL_CHARS)
    # Kept loaded: the agent never unloads it to make room.
    pinned: bool = False


class DesiredShard(_Wire):
    """One shard the node should run (or hold suspended, or stop)."""

    shard_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    replica_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    rank: int = Field(default=0, ge=0)
    desired_state: DesiredState = "running"
    # Identifies the launch-relevant content of the spec. The agent restarts
    # a running engine only when this (or the spec) changed.
    fingerprint: str = Field(default="", max_length=MAX_ID_CHARS)
    # llmgw.engines.ShardSpec as JSON, without api_key; the agent parses it
    # and reports a spec it cannot parse for this shard alone.
    spec: dict[str, Any]
    # The key the engine demands of every request. A secret: excluded from repr.
    engine_api_key: str = Field(default="", max_length=MAX_TOKEN_CHARS, repr=False)
    # The model's name, for logs and metrics.
    model: str = Field(default="", max_length=MAX_NAME_CHARS)
    # The runtime adapters the engine should hold loaded (rank 0 of a profile with
    # adapter_slots > 0; the leader's placement). Not part of the spec nor its fingerprint:
    # a change loads or unloads adapters in the running engine, never restarts it.
    adapters: tuple[RuntimeAdapter, ...] = Field(default=(), max_length=MAX_RUNTIME_ADAPTERS)


class SyncResponse(_Wire):
    cluster_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    # The instance that answered.
    instance_id: str = Field(default="", max_length=MAX_ID_CHARS)
    instances: tuple[ControlPlaneInstance, ...] = Field(default=(), max_length=MAX_INSTANCES)
    approval_state: ApprovalState = "approved"
    desired_version: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    # True when desired_version equals the request's: shards is then None and
    # the agent keeps what it has.
    unchanged: bool = False
    # The node's complete desired shard set when changed; None when unchanged
    # (or while the node is pending).
    shards: tuple[DesiredShard, ...] | None = Field(default=None, max_length=MAX_SHARDS)
    # The control plane means it: stopping more than half of the node's
    # shards in this sync is an operator's drain, not a bug or a restored
    # database. Without it the agent keeps them running.
    confirmed_drain: bool = False
