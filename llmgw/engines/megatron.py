"""The Megatron-core dynamic inference engine adapter: torchrun + launch_inference_server.

Flags are the reference's (engines.md §5.1, Megatron-LM d98e8a6:
examples/inference/run_inference_server.sh). Megatron has no authentication and
no /metrics; it can suspend and resume its engine. The tokenizer comes from
the checkpoint's stored arguments (--use-checkpoint-args) unless the profile's
args name one. This module must NOT add tuning defaults (dynamic-batching
buffer, max requests and tokens, chunked prefill): those belong to the
profile's args, where an operator sees them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmgw.engines.command import Command
from llmgw.engines.config import MegatronConfig
from llmgw.engines.engine import (
    COORDINATOR_RESUME_CALLS,
    COORDINATOR_SUSPEND_CALLS,
    Engine,
    Readiness,
)
from llmgw.engines.env import materialize_env, shard_env
from llmgw.engines.flags import ReservedFlag
from llmgw.engines.spec import GPUInfo, Profile, ShardSpec
from llmgw.engines.validation import EngineTraits
from llmgw.errors import SpecError

__all__ = ["SERVER_MODULE", "Megatron"]

SERVER_MODULE = "examples.inference.launch_inference_server"

_RESERVED = (
    ReservedFlag(("--host",), "the agent's bind address (ShardSpec.bind_addr)"),
    ReservedFlag(("--port",), "the port the agent chooses (ShardSpec.http_port)"),
    ReservedFlag(("--tensor-model-parallel-size",), "profile.tp"),
    ReservedFlag(("--pipeline-model-parallel-size",), "profile.pp"),
    ReservedFlag(("--load",), "profile.model_path"),
)


class Megatron(Engine):
    traits = EngineTraits(
        name="megatron",
        multi_node=True,
        cpu=False,
        kv_events=False,
        quantization_flags=(),
        dtype_flags=(),
        bf16_flags=("--bf16",),
    )
    metrics_path = None
    # 503 until the InferenceClient exists, then 200 {"ready": true}.
    readiness = Readiness(loading_statuses=frozenset({503}))
    display_name = "Megatron-core"
    all_reserved = _RESERVED
    authenticates = False
    suspend_calls = COORDINATOR_SUSPEND_CALLS
    resume_calls = COORDINATOR_RESUME_CALLS

    def __init__(self, cfg: MegatronConfig | None = None) -> None:
        self._cfg = cfg or MegatronConfig()

    def reserved_flags(self, profile: Profile) -> list[ReservedFlag]:
        return list(_RESERVED)

    def _validate_engine(self, profile: Profile, gpus: Sequence[GPUInfo]) -> list[str]:
        if profile.adapters:
            raise SpecError(
                f"profile {profile.name!r}: megatron serves no LoRA adapters, the profile lists "
                f"{len(profile.adapters)}; remove them or use vllm or sglang",
                field="profile.adapters",
            )
        return []

    def help_command(self, command: Command) -> tuple[str, tuple[str, ...]]:
        # torchrun --help describes torchrun; the server's flags are the module's.
        return self._cfg.python, ("-m", SERVER_MODULE, "--help")

    def _commands(self, spec: ShardSpec, inherited: Mapping[str, str]) -> list[Command]:
        p = spec.profile
        if spec.nnodes > 1:
            rdzv = [
                "--nnodes",
                str(spec.nnodes),
                "--node-rank",
                str(spec.rank),
                "--master-addr",
                spec.leader_addr,
                "--master-port",
                str(spec.leader_port),
            ]
        else:
            # A free local rendezvous port, which no leader_port is needed for.
            rdzv = ["--standalone"]
        args = [
            "--nproc-per-node",
            str(p.per_node),
            *rdzv,
            "-m",
            SERVER_MODULE,
            "--tensor-model-parallel-size",
            str(p.tp),
            "--pipeline-model-parallel-size",
            str(p.pp_degree),
            "--load",
            p.model_path,
            "--use-checkpoint-args",
            "--host",
            spec.host,
            "--port",
            str(spec.http_port),
            *p.args,
        ]
        # Required with tensor parallelism: kernels must be queued in issue
        # order for Megatron's communication overlap to be correct.
        extra = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        if self._cfg.megatron_dir:
            # `examples` is a directory of the checkout, not an installed package.
            extra["PYTHONPATH"] = self._cfg.megatron_dir
        env = materialize_env(inherited, shard_env(spec, extra), spec)
        return [Command(name="torchrun", path=self._cfg.torchrun_path, args=tuple(args), env=env)]
