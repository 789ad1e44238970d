"""The wire models the node agent and the control plane share, and nothing else.

`llmgw.nodeagent` and `llmgw.controlplane` never import each other
(docs/architecture.md §2): this package is the whole contract between them. It
must NOT import either side, do I/O, or read the environment. Submodules:

- `llmgw.protocol.sync`: registration and the declarative sync (this package's
  re-exports below);
- `llmgw.protocol.kvstream`: the KV-delta stream (imported by its own name).
"""

from llmgw.protocol.sync import (
    KV_PATH,
    MAX_BINDINGS,
    MAX_INSTANCES,
    MAX_LOG_TAIL_CHARS,
    MAX_REASON_CHARS,
    MAX_SHARDS,
    PROTOCOL_VERSION,
    REGISTER_PATH,
    SYNC_PATH,
    ApprovalState,
    ControlPlaneInstance,
    DesiredShard,
    DesiredState,
    FabricInfo,
    GpuDevice,
    InstalledEngine,
    NodeInventory,
    ObservedState,
    ProtocolErrorBody,
    RegisterRequest,
    RegisterResponse,
    ShardBinding,
    SyncRequest,
    SyncResponse,
)

__all__ = [
    "KV_PATH",
    "MAX_BINDINGS",
    "MAX_INSTANCES",
    "MAX_LOG_TAIL_CHARS",
    "MAX_REASON_CHARS",
    "MAX_SHARDS",
    "PROTOCOL_VERSION",
    "REGISTER_PATH",
    "SYNC_PATH",
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
    "ShardBinding",
    "SyncRequest",
    "SyncResponse",
]
