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
    check_secret_refs,
    profile_fingerprint,
)
from llmgw.errors import LlmgwError, SpecError

__all__ = ["LAUNCH_FIELDS", "SPEC_FIELDS", "check_profile", "engine_profile"]

# The control plane validates what *some* node could run. Whether a given node
# offers an engine (TensorRT-LLM only where its trtllm-serve is configured, none
# that the node disables) is the agent's and placement's business, so this
# registry offers every engine.
_REGISTRY = EngineRegistry(EnginesConfig(trtllm=TRTLLMConfig(serve_path="trtllm-serve")))


# The stored profile columns the engine's view is built from: every one of them can change the
# launched process. An update merges its changes over these, then checks the whole profile.
LAUNCH_FIELDS = (
    "engine", "gpu_class", "tp", "pp", "gpus_per_node", "nodes", "model_path", "served_model_name",
    "args", "env", "secret_env", "adapters", "kv_events", "threads", "kv_hash_seed",
    "kv_block_size", "kv_hash_algo", "kv_extra_key_format", "multinode_backend", "adapter_slots",
)  # fmt: skip
# What a shard's launch spec carries of the profile: the launch fields, and those read beside the
# process (the tokenizer whose files the agent ships; the API families the gateways send it,
# which the route table falls back to when the profile is gone), which change no command and
# so no fingerprint.
SPEC_FIELDS = (*LAUNCH_FIELDS, "tokenizer", "apis")


def engine_profile(name: str, fields: Mapping[str, Any], *, model: str = "") -> Profile:
    """The engines package's Profile for a complete set of LAUNCH_FIELDS, and SPEC_FIELDS' others
    where given (defaults are the API schema's and the table's business, not repeated here).

    `model` is the model's name, what clients send: the engine answers to it when
    served_model_name is empty, as the admin API documents (issue 8 item 9). Without it
    the engines package can only fall back to model_path.
    """
    return Profile(
        name=name,
        model=model,
        engine=fields["engine"],
        gpu_class=fields["gpu_class"],
        tp=fields["tp"],
        pp=fields["pp"],
        gpus_per_node=fields["gpus_per_node"],
        nodes=fields["nodes"],
        args=tuple(fields["args"]),
        env=dict(fields["env"]),
        secret_env=dict(fields["secret_env"]),
        model_path=fields["model_path"],
        served_model_name=fields["served_model_name"],
        adapters=tuple(Adapter(name=a["name"], path=a["path"]) for a in fields["adapters"]),
        kv_events=fields["kv_events"],
        threads=fields["threads"],
        kv_hash=KVHashParams(
            seed=fields["kv_hash_seed"],
            block_size=fields["kv_block_size"],
            algorithm=fields["kv_hash_algo"],
            extra_key_format=fields["kv_extra_key_format"],
        ),
        # Ray or vLLM's own launcher: a different process tree, so it counts like any arg.
        multinode_backend=fields.get("multinode_backend", "ray"),
        # The flags the engine adds for it are in the fingerprint; the adapters the leader
        # places on a replica are not. A field set from before it existed means 0.
        adapter_slots=fields.get("adapter_slots", 0),
        # Read by the agent that ships the tokenizer files; no command changes with it.
        tokenizer=fields.get("tokenizer", ""),
        # Read by the gateways' route table; no command changes with it either.
        apis=tuple(fields.get("apis", ())),
    )


def check_profile(name: str, fields: Mapping[str, Any], *, model: str = "") -> str:
    """Validate a profile as its engine would; return its fingerprint.

    `model`: the profile's model's name (see engine_profile); callers pass it.

    Raises SpecError naming the profile, the rule and the numbers. GPUs are not
    known yet (placement picks them), so only the GPU-independent rules apply here;
    the agent validates again against the node's real GPUs before starting.

    A secret_env value must be a reference (the agent's own check, shared): a literal
    secret refused here is never stored, copied into a shard's spec or sent to a node.
    """
    try:
        check_secret_refs(fields["secret_env"])
        profile = engine_profile(name, fields, model=model)
        _REGISTRY.get(profile.engine).validate(profile, [])
    except LlmgwError as exc:
        # The engines package names fields from the shard spec's view ("profile.tp");
        # the admin API's body is the profile itself.
        field = exc.field.removeprefix("profile.") if exc.field else None
        raise SpecError(exc.message, field=field) from None
    except ValueError as exc:  # pydantic: a value the engine's Profile type refuses
        raise SpecError(f"profile {name!r}: {exc}") from None
    return str(profile_fingerprint(profile))
