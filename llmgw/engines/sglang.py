"""The SGLang adapter: `python -m sglang.launch_server`, on one node or natively across nodes.

Flags are the reference's (engines.md §2: python/sglang/srt/server_args.py).
This module must NOT put the API key on argv: SGLang has no environment
variable for it, so it goes into a 0600 config file the agent writes.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping

from llmgw.engines.adapter_slots import SlotFlags, slot_args
from llmgw.engines.command import Command, CommandFile
from llmgw.engines.config import SGLangConfig
from llmgw.engines.engine import Engine, Readiness, host_port
from llmgw.engines.env import materialize_env, shard_env
from llmgw.engines.flags import ReservedFlag, has_flag
from llmgw.engines.runtime_adapters import SGLANG_RUNTIME_ADAPTERS
from llmgw.engines.spec import Profile, ShardSpec
from llmgw.engines.validation import EngineTraits
from llmgw.errors import SpecError

__all__ = ["CONFIG_FILE_NAME", "SGLang"]

CONFIG_FILE_NAME = "sglang-config.yaml"
_MODULE = ("-m", "sglang.launch_server")

_RESERVED = (
    ReservedFlag(("--host",), "the agent's bind address (ShardSpec.bind_addr)"),
    ReservedFlag(("--port",), "the port the agent chooses (ShardSpec.http_port)"),
    ReservedFlag(("--model-path", "--model"), "profile.model_path"),
    ReservedFlag(("--served-model-name",), "profile.served_model_name"),
    ReservedFlag(("--tp-size", "--tensor-parallel-size", "--tp"), "profile.tp"),
    ReservedFlag(("--pp-size", "--pipeline-parallel-size"), "profile.pp"),
    ReservedFlag(("--nnodes",), "profile.nodes"),
    ReservedFlag(("--node-rank",), "placement (ShardSpec.rank)"),
    ReservedFlag(("--dist-init-addr", "--nccl-init-addr"), "placement (ShardSpec.leader_addr)"),
    ReservedFlag(("--api-key",), "the shard's API key, which llmgw issues"),
    ReservedFlag(("--kv-events-config",), "profile.kv_events"),
    ReservedFlag(("--lora-paths",), "profile.adapters"),
    # The adapter's config file carries the API key; a second one could set
    # any flag above where no check sees it.
    ReservedFlag(("--config",), "profile.args (flags, one per element)"),
    # CUDA_VISIBLE_DEVICES renumbers the shard's GPUs from 0; a base id would
    # point past them, at cards another shard holds.
    ReservedFlag(("--base-gpu-id",), "placement (ShardSpec.gpu_indices)"),
    # Auto-detection can settle on the CPU and keep serving, slowly.
    ReservedFlag(("--device",), "profile.gpu_class"),
)

# Runtime LoRA adapters (profile.adapter_slots; issue [lora]). SGLang counts every registered
# adapter, --lora-paths included, against --max-loaded-loras (its tokenizer manager refuses a
# load past it, and it refuses to start with more --lora-paths than that), and requires
# --max-loaded-loras >= --max-loras-per-batch (server_args.py). With no --lora-paths it sizes
# its LoRA memory pool from --max-lora-rank and --lora-target-modules, and refuses to start
# without both ("When no initial --lora-paths is provided, you need to specify both ...").
_LORA_SLOTS = SlotFlags(held=("--max-loaded-loras",), batch=("--max-loras-per-batch",))
_ENABLE_LORA = "--enable-lora"
_LORA_SHAPE = (("--max-lora-rank",), ("--lora-target-modules",))
_LORA_KNOWN = frozenset(
    {_ENABLE_LORA, "--max-loaded-loras", "--max-loras-per-batch", "--max-lora-rank",
     "--lora-target-modules", "--lora-backend", "--lora-eviction-policy"}
)  # fmt: skip


class SGLang(Engine):
    traits = EngineTraits(
        name="sglang",
        multi_node=True,
        cpu=False,
        # SGLang's --kv-events-config publishes Dynamo's format, which the
        # agent does not read yet.
        kv_events=False,
        dp_flags=("--dp-size", "--data-parallel-size", "--dp"),
        # 0.5.23: with DP attention the DP ranks split the TP group's GPUs.
        dp_within_tp_flags=("--enable-dp-attention",),
    )
    # 503 while ServerStatus.Starting, 200 once ready.
    readiness = Readiness(loading_statuses=frozenset({503}))
    all_reserved = _RESERVED
    # launch_server names the tokenizer's directory --tokenizer-path (vLLM's --tokenizer).
    tokenizer_flags = ("--tokenizer-path",)
    runtime_adapters = SGLANG_RUNTIME_ADAPTERS
    display_name = "SGLang"

    def __init__(self, cfg: SGLangConfig | None = None) -> None:
        self._cfg = cfg or SGLangConfig()

    def _lora_known(self) -> frozenset[str]:
        return self.known_flags() | _LORA_KNOWN

    def _check_adapter_args(self, profile: Profile) -> None:
        missing = [
            names[0]
            for names in _LORA_SHAPE
            if not has_flag(profile.args, names, self.syntax, self._lora_known())
        ]
        if missing and not profile.adapters:
            raise SpecError(
                f"profile {profile.name!r}: adapter_slots is {profile.adapter_slots} and the "
                f"profile lists no adapters, so SGLang sizes its LoRA memory at start from "
                f"--max-lora-rank and --lora-target-modules, and refuses to start without "
                f"them; add {' and '.join(missing)} to args (e.g. --max-lora-rank 64 "
                f"--lora-target-modules all: the largest rank and the modules of every adapter "
                f"it will load)",
                field="profile.args",
            )
        self._slot_args(profile)

    def _slot_args(self, profile: Profile) -> list[str]:
        return slot_args(
            profile,
            _LORA_SLOTS,
            held=profile.adapter_slots + len(profile.adapters),
            syntax=self.syntax,
            known=self._lora_known(),
            engine="SGLang",
        )

    def reserved_flags(self, profile: Profile) -> list[ReservedFlag]:
        return list(_RESERVED)

    def help_command(self, command: Command) -> tuple[str, tuple[str, ...]]:
        return self._cfg.python, (*_MODULE, "--help")

    def _commands(self, spec: ShardSpec, inherited: Mapping[str, str]) -> list[Command]:
        p = spec.profile
        args = [
            *_MODULE,
            "--model-path",
            p.model_path,
            "--served-model-name",
            p.served_name,
            "--host",
            spec.host,
            "--port",
            str(spec.http_port),
            "--tp-size",
            str(p.tp),
            "--pp-size",
            str(p.pp_degree),
            "--device",
            "cuda",
            "--enable-metrics",
        ]
        if spec.nnodes > 1:
            # Ranks >= 1 run schedulers and a dummy health server on
            # host:port; serves_http keeps the agent from trusting it.
            args += [
                "--nnodes",
                str(spec.nnodes),
                "--node-rank",
                str(spec.rank),
                "--dist-init-addr",
                host_port(spec.leader_addr, spec.leader_port),
            ]
        if p.adapters:
            args += ["--enable-lora", "--lora-paths", *(f"{a.name}={a.path}" for a in p.adapters)]
        if p.adapter_slots > 0:
            # Every rank: the LoRA sizes shape each scheduler's memory pool.
            if not p.adapters and not has_flag(
                p.args, (_ENABLE_LORA,), self.syntax, self._lora_known()
            ):
                args.append(_ENABLE_LORA)
            args += self._slot_args(p)
        files: tuple[CommandFile, ...] = ()
        if spec.api_key:
            path = (
                posixpath.join(spec.runtime_dir, CONFIG_FILE_NAME)
                if spec.runtime_dir
                else CONFIG_FILE_NAME
            )
            # SGLang's YAML keys are its flag names; a JSON string is a valid
            # YAML double-quoted scalar, whatever characters the key holds.
            content = f"api-key: {json.dumps(spec.api_key)}\n"
            files = (CommandFile(path=path, mode=0o600, content=content, secret=True),)
            args += ["--config", path]
        args += p.args
        env = materialize_env(inherited, shard_env(spec), spec)
        return [
            Command(name="sglang", path=self._cfg.python, args=tuple(args), env=env, files=files)
        ]
