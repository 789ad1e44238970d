"""From an admin's profile fields to a checked engine profile and its fingerprint.

The admin API stores what operators wrote; launching uses ``llmgw.engines``.
This module is the one bridge: it builds the engine's view of a profile, runs
the engine's own validation (parallelism, unsafe variables, reserved flags,
KV-event rules) before anything is stored, and computes the fingerprint that
decides whether replicas roll. Pure: no database, no HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.engines import (
    Adapter,
    EngineRegistry,
    EnginesConfig,
    KVHashParams,
    Profile,
    TRTLLMConfig,
    profile_fingerprint,
)
from llmgw.errors import LlmgwError, SpecError

__all__ = ["check_profile", "engine_profile"]

# The control plane validates what *some* node could run. Whether a given node
# offers an engine (TensorRT-LLM only where its trtllm-serve is configured, none
# that the node disables) is the agent's and placement's business, so this
# registry offers every engine.
_REGISTRY = EngineRegistry(EnginesConfig(trtllm=TRTLLMConfig(serve_path="trtllm-serve")))


def engine_profile(name: str, fields: Mapping[str, Any]) -> Profile:
    """The engines package's Profile for stored or submitted profile fields."""
    return Profile(
        name=name,
        engine=fields["engine"],
        gpu_class=fields.get("gpu_class", ""),
        tp=fields.get("tp", 1),
        pp=fields.get("pp", 1),
        gpus_per_node=fields.get("gpus_per_node", 0),
        nodes=fields.get("nodes", 1),
        args=tuple(fields.get("args", ())),
        env=dict(fields.get("env", {})),
        secret_env=dict(fields.get("secret_env", {})),
        model_path=fields["model_path"],
        served_model_name=fields.get("served_model_name", ""),
        adapters=tuple(Adapter(name=a["name"], path=a["path"]) for a in fields.get("adapters", ())),
        kv_events=fields.get("kv_events", False),
        threads=fields.get("threads", 0),
        kv_hash=KVHashParams(
            seed=fields.get("kv_hash_seed", ""),
            block_size=fields.get("kv_block_size", 16),
            algorithm=fields.get("kv_hash_algo", "sha256_cbor"),
            extra_key_format=fields.get("kv_extra_key_format", "tagged"),
        ),
    )


def check_profile(name: str, fields: Mapping[str, Any]) -> str:
    """Validate a profile as its engine would; return its fingerprint.

    Raises SpecError naming the profile, the rule and the numbers. GPUs are not
    known yet (placement picks them), so only the GPU-independent rules apply here;
    the agent validates again against the node's real GPUs before starting.
    """
    try:
        profile = engine_profile(name, fields)
        _REGISTRY.get(profile.engine).validate(profile, [])
    except LlmgwError as exc:
        # The engines package names fields from the shard spec's view ("profile.tp");
        # the admin API's body is the profile itself.
        field = exc.field.removeprefix("profile.") if exc.field else None
        raise SpecError(exc.message, field=field) from None
    except ValueError as exc:  # pydantic: a value the engine's Profile type refuses
        raise SpecError(f"profile {name!r}: {exc}") from None
    return str(profile_fingerprint(profile))
