"""Builders for the engines tests: a profile and a shard spec with readable defaults."""

from __future__ import annotations

from typing import Any

from llmgw.engines import EngineRegistry, EnginesConfig, Profile, ShardSpec, SimConfig, TRTLLMConfig
from llmgw.engines.command import Command

__all__ = ["BASE_ENV", "SEED", "build", "profile", "registry", "spec"]

SEED = "3054198966"  # a PYTHONHASHSEED Python accepts: 1..2**32-1
# What an agent's unit file typically hands down, plus things that must not pass.
BASE_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/root",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    "LLMGW_AGENT_TOKEN": "agent-secret",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    "VLLM_API_KEY": "the-agents-own-key",
}


def registry() -> EngineRegistry:
    return EngineRegistry(
        EnginesConfig(
            sim=SimConfig(python_executable="/opt/llmgw/bin/python"),
            trtllm=TRTLLMConfig(serve_path="/opt/trtllm/bin/trtllm-serve"),
        )
    )


def profile(**kw: Any) -> Profile:
    fields: dict[str, Any] = {
        "name": "llama-h100",
        "engine": "vllm",
        "gpu_class": "h100",
        "model_path": "/models/llama-3-8b",
        "served_model_name": "llama-3-8b",
    }
    fields.update(kw)
    return Profile.model_validate(fields)


def spec(prof: Profile, **kw: Any) -> ShardSpec:
    fields: dict[str, Any] = {
        "replica_id": "rep-1",
        "shard_id": "shard-1",
        "http_port": 8100,
        "gpu_indices": list(range(prof.per_node)) if not prof.cpu_only else [],
        "profile": prof,
    }
    fields.update(kw)
    return ShardSpec.model_validate(fields)


def build(s: ShardSpec, base_env: dict[str, str] | None = None) -> list[Command]:
    return (
        registry()
        .get(s.profile.engine)
        .commands(s, base_env=base_env if base_env is not None else BASE_ENV)
    )
