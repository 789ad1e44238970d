"""Engine launch adapters: a profile and a shard spec in, the exact processes to start out.

Pure: nothing here starts a process, reads a file or the environment, or
opens a socket (a test walks the imports). The agent runs what this builds;
the control plane validates profiles and fingerprints them with it.

    registry = EngineRegistry(EnginesConfig(sim=SimConfig(python_executable=sys.executable)))
    engine = registry.get(spec.profile.engine)
    warnings = engine.validate(spec.profile, gpus)
    commands = engine.commands(spec, base_env=base_env_from(os.environ))
    needs = placement_requirements(spec.profile)   # for placement

Engines are no security boundary, and neither are args. llmgw refuses only
what would break its own bookkeeping (reserved flags, code-loading variables);
every other arg passes, `--trust-remote-code`, `--worker-extension-cls` and
`--middleware` included, and each of those runs code the profile names. So
whoever holds the admin token can run any code, as the agent's user (often
root), on every node that runs the profile. A node that must not allow some
flags refuses them in its own policy with `refused_flags` (or
`Engine.refused_flags`), which matches every spelling the engine's parser
accepts: `--trust_remote_code`, `--trust-rem`, `--trust-remote-code=true`.
"""

from llmgw.engines.admission import default_max_in_flight, max_in_flight
from llmgw.engines.command import (
    REDACTED,
    Command,
    CommandFile,
    redact_commands,
    redact_secret_names,
)
from llmgw.engines.config import (
    EnginesConfig,
    LlamaCppConfig,
    MegatronConfig,
    SGLangConfig,
    SimConfig,
    TRTLLMConfig,
    VLLMConfig,
)
from llmgw.engines.engine import Engine, HealthState, LoadMetrics, Readiness
from llmgw.engines.env import (
    BASE_ENV_NAMES,
    BASE_ENV_PREFIXES,
    OWNED_ENV,
    UNSAFE_ENV,
    base_env_from,
    is_secret_name,
    shard_env,
    unsafe_env_reason,
)
from llmgw.engines.fingerprint import ProfileFingerprint, profile_fingerprint
from llmgw.engines.flags import FLAG_SYNTAX, FlagSyntax, refused_flags
from llmgw.engines.registry import (
    ANY_ENGINE_LOAD_METRICS,
    ENGINE_NAMES,
    EngineRegistry,
    engine_load_metrics,
    reference_engine,
)
from llmgw.engines.requirements import (
    PlacementRequirements,
    check_replica_specs,
    placement_requirements,
)
from llmgw.engines.secret_refs import SecretReference, check_secret_refs, parse_secret_ref
from llmgw.engines.spec import (
    API_GENERATE,
    API_GROUPS,
    API_POOLING,
    CPU_GPU_CLASS,
    ENGINE_ALIASES,
    MAX_HASH_SEED,
    TOKENIZER_NONE,
    Adapter,
    ApiGroup,
    GPUInfo,
    KVHashParams,
    Profile,
    ReplicaId,
    ShardId,
    ShardSpec,
    apis_problem,
    canonical_engine,
    hash_seed_problem,
    is_valid_hash_seed,
    parse_gpus,
    parse_shard_spec,
    tokenizer_problem,
)

__all__ = [
    "ANY_ENGINE_LOAD_METRICS",
    "API_GENERATE",
    "API_GROUPS",
    "API_POOLING",
    "BASE_ENV_NAMES",
    "BASE_ENV_PREFIXES",
    "CPU_GPU_CLASS",
    "ENGINE_ALIASES",
    "ENGINE_NAMES",
    "FLAG_SYNTAX",
    "MAX_HASH_SEED",
    "OWNED_ENV",
    "REDACTED",
    "TOKENIZER_NONE",
    "UNSAFE_ENV",
    "Adapter",
    "ApiGroup",
    "Command",
    "CommandFile",
    "Engine",
    "EngineRegistry",
    "EnginesConfig",
    "FlagSyntax",
    "GPUInfo",
    "HealthState",
    "KVHashParams",
    "LlamaCppConfig",
    "LoadMetrics",
    "MegatronConfig",
    "PlacementRequirements",
    "Profile",
    "ProfileFingerprint",
    "Readiness",
    "ReplicaId",
    "SGLangConfig",
    "SecretReference",
    "ShardId",
    "ShardSpec",
    "SimConfig",
    "TRTLLMConfig",
    "VLLMConfig",
    "apis_problem",
    "base_env_from",
    "canonical_engine",
    "check_replica_specs",
    "check_secret_refs",
    "default_max_in_flight",
    "engine_load_metrics",
    "hash_seed_problem",
    "is_secret_name",
    "is_valid_hash_seed",
    "max_in_flight",
    "parse_gpus",
    "parse_secret_ref",
    "parse_shard_spec",
    "placement_requirements",
    "profile_fingerprint",
    "redact_commands",
    "redact_secret_names",
    "reference_engine",
    "refused_flags",
    "shard_env",
    "tokenizer_problem",
    "unsafe_env_reason",
]
