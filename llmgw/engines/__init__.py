"""Engine launch adapters: a profile and a shard spec in, the exact processes to start out.

Pure: nothing here starts a process, reads a file or the environment, or
opens a socket (a test walks the imports). The agent runs what this builds;
the control plane validates profiles and fingerprints them with it.

    registry = EngineRegistry(EnginesConfig(sim=SimConfig(python_executable=sys.executable)))
    engine = registry.get(spec.profile.engine)
    warnings = engine.validate(spec.profile, gpus)
    commands = engine.commands(spec, base_env=dict(os.environ))
"""

from llmgw.engines.command import REDACTED, Command, CommandFile, redact_commands
from llmgw.engines.config import (
    EnginesConfig,
    LlamaCppConfig,
    MegatronConfig,
    SGLangConfig,
    SimConfig,
    TRTLLMConfig,
    VLLMConfig,
)
from llmgw.engines.engine import Engine, HealthState, Readiness
from llmgw.engines.env import OWNED_ENV, UNSAFE_ENV, shard_env, unsafe_env_reason
from llmgw.engines.fingerprint import ProfileFingerprint, profile_fingerprint
from llmgw.engines.registry import ENGINE_NAMES, EngineRegistry
from llmgw.engines.spec import (
    CPU_GPU_CLASS,
    MAX_HASH_SEED,
    Adapter,
    GPUInfo,
    KVHashParams,
    Profile,
    ReplicaId,
    ShardId,
    ShardSpec,
    is_valid_hash_seed,
    parse_gpus,
    parse_shard_spec,
)

__all__ = [
    "CPU_GPU_CLASS",
    "ENGINE_NAMES",
    "MAX_HASH_SEED",
    "OWNED_ENV",
    "REDACTED",
    "UNSAFE_ENV",
    "Adapter",
    "Command",
    "CommandFile",
    "Engine",
    "EngineRegistry",
    "EnginesConfig",
    "GPUInfo",
    "HealthState",
    "KVHashParams",
    "LlamaCppConfig",
    "MegatronConfig",
    "Profile",
    "ProfileFingerprint",
    "Readiness",
    "ReplicaId",
    "SGLangConfig",
    "ShardId",
    "ShardSpec",
    "SimConfig",
    "TRTLLMConfig",
    "VLLMConfig",
    "is_valid_hash_seed",
    "parse_gpus",
    "parse_shard_spec",
    "profile_fingerprint",
    "redact_commands",
    "shard_env",
    "unsafe_env_reason",
]
