"""The simulator adapter: `llmgw simengine`, launched exactly like a real engine.

The command line is the contract with llmgw/simengine (SIMCLI): flags reuse
vLLM's names where vLLM has the concept, so the agent's KV-event plumbing
serves both. This module must NOT read sys.executable: the interpreter comes
from SimConfig, which the agent fills in.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping

from llmgw.engines.adapter_slots import SlotFlags, slot_args
from llmgw.engines.command import Command
from llmgw.engines.config import SimConfig
from llmgw.engines.engine import (
    COORDINATOR_RESUME_CALLS,
    COORDINATOR_SUSPEND_CALLS,
    Engine,
    Readiness,
)
from llmgw.engines.env import materialize_env, shard_env
from llmgw.engines.flags import ReservedFlag, flag_value, has_flag
from llmgw.engines.kv_config import kv_events_config
from llmgw.engines.runtime_adapters import VLLM_RUNTIME_ADAPTERS
from llmgw.engines.spec import API_GROUPS, Profile, ShardSpec
from llmgw.engines.validation import EngineTraits
from llmgw.engines.vllm import VLLM_LOAD_METRICS

__all__ = ["TINY_MODEL_DIR", "TOKENIZER_BUILTIN", "TOKENIZER_TINY", "Sim"]

_PROGRAM = ("-m", "llmgw", "simengine")
_RESERVED = (
    ReservedFlag(("--host",), "the agent's bind address (ShardSpec.bind_addr)"),
    ReservedFlag(("--port",), "the port the agent chooses (ShardSpec.http_port)"),
    ReservedFlag(("--model",), "profile.model_path"),
    ReservedFlag(("--served-model-name",), "profile.served_model_name"),
    ReservedFlag(("--lora-modules",), "profile.adapters"),
    ReservedFlag(("--block-size",), "profile.kv_hash.block_size"),
    ReservedFlag(("--kv-events-config",), "profile.kv_events"),
    ReservedFlag(("--kv-extra-key-format",), "profile.kv_hash.extra_key_format"),
)

# The simulator's `--tokenizer` keywords (any other value is a model directory): the packaged
# tiny model, which the adapter passes to a profile whose args name no tokenizer, and the
# constructed vocabulary, which has no files.
TOKENIZER_TINY = "tiny"
TOKENIZER_BUILTIN = "builtin"

# Runtime LoRA adapters as vLLM's (llmgw/simengine/lora_runtime.py): --max-cpu-loras held, --max-loras
# per batch, the routes served only with VLLM_ALLOW_RUNTIME_LORA_UPDATING true.
_LORA_SLOTS = SlotFlags(held=("--max-cpu-loras",), batch=("--max-loras",))
_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

# The packaged tiny model's directory (its tokenizer.json and tokenizer_config.json): llmgw's
# own, beside this package, wherever llmgw is installed.
TINY_MODEL_DIR = posixpath.join(posixpath.dirname(posixpath.dirname(__file__)), "tinymodel")


class Sim(Engine):
    traits = EngineTraits(name="sim", multi_node=False, cpu=True, kv_events=True)
    # Unlike vLLM the simulator answers while "loading": 503, then 200.
    readiness = Readiness(loading_statuses=frozenset({503}))
    load_metrics = VLLM_LOAD_METRICS
    all_reserved = _RESERVED
    suspend_calls = COORDINATOR_SUSPEND_CALLS
    resume_calls = COORDINATOR_RESUME_CALLS
    runtime_adapters = VLLM_RUNTIME_ADAPTERS

    def __init__(self, cfg: SimConfig | None = None) -> None:
        self._cfg = cfg or SimConfig()

    def _check_adapter_args(self, profile: Profile) -> None:
        self._slot_args(profile)

    def _slot_args(self, profile: Profile) -> list[str]:
        return slot_args(
            profile,
            _LORA_SLOTS,
            held=profile.adapter_slots,
            syntax=self.syntax,
            known=self.known_flags(),
            engine="the simulator",
        )

    def reserved_flags(self, profile: Profile) -> list[ReservedFlag]:
        return list(_RESERVED)

    def help_command(self, command: Command) -> tuple[str, tuple[str, ...]]:
        return self._cfg.python_executable, (*_PROGRAM, "--help")

    def tokenizer_dir(self, profile: Profile) -> str | None:
        # A sim profile's model_path is sim://..., never a directory: the files are those of
        # the --tokenizer this adapter passes (the tiny model unless the args name another).
        named = flag_value(profile.args, self.tokenizer_flags, self.syntax, self.known_flags())
        if named is None or named == TOKENIZER_TINY:
            return TINY_MODEL_DIR
        if named == TOKENIZER_BUILTIN:
            return None
        return named

    def default_apis(self, profile: Profile) -> frozenset[str]:
        # One simulator process answers generation and /v1/embeddings alike, so the demo and
        # the tests reach every route without a second model.
        return frozenset(API_GROUPS)

    def _commands(self, spec: ShardSpec, inherited: Mapping[str, str]) -> list[Command]:
        p = spec.profile
        args = [
            *_PROGRAM,
            "--model",
            p.model_path,
            "--served-model-name",
            p.served_name,
            "--host",
            spec.host,
            "--port",
            str(spec.http_port),
            # The simulated KV cache always has blocks; with kv_events the
            # router hashes prompts in blocks of the same size.
            "--block-size",
            str(p.kv_hash.block_size),
            "--kv-extra-key-format",
            p.kv_hash.extra_key_format,
        ]
        for a in p.adapters:
            args += ["--lora-modules", f"{a.name}={a.path}"]
        if p.adapter_slots > 0:
            args += self._slot_args(p)
        if p.kv_events:
            args += ["--kv-events-config", kv_events_config(spec)]
        if not has_flag(p.args, self.tokenizer_flags, self.syntax, self.known_flags()):
            # sim:// models tokenize with the packaged tiny model's files by default, so the
            # agent ships them (tokenizer_dir) and gateways tokenize locally exactly as this
            # engine does; `--tokenizer builtin` in the profile's args keeps the constructed
            # vocabulary.
            args += ["--tokenizer", TOKENIZER_TINY]
        args += p.args
        extra: dict[str, str] = {}
        if spec.api_key:
            extra["SIMENGINE_API_KEY"] = spec.api_key
        if p.kv_events:
            extra["PYTHONHASHSEED"] = p.kv_hash.seed
        if p.adapter_slots > 0:
            extra[_RUNTIME_LORA_ENV] = "True"
        env = materialize_env(inherited, shard_env(spec, extra), spec)
        return [
            Command(name="simengine", path=self._cfg.python_executable, args=tuple(args), env=env)
        ]
