"""Per-node configuration of the engine adapters: programs, launchers, disabled engines.

Nested inside the agent's settings, so each field is an `LLMGW_ENGINES__...`
variable or a config-file key there. This module must NOT look anything up
(PATH, sys.executable): the agent resolves paths and passes them in.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = [
    "EnginesConfig",
    "LlamaCppConfig",
    "MegatronConfig",
    "SGLangConfig",
    "SimConfig",
    "TRTLLMConfig",
    "VLLMConfig",
]


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class VLLMConfig(_Config):
    path: str = "vllm"
    # Ray's CLI, for multi-node replicas under Ray.
    ray_path: str = "ray"


class SGLangConfig(_Config):
    # The interpreter SGLang is installed in; started as `python -m sglang.launch_server`.
    python: str = "python3"


class LlamaCppConfig(_Config):
    path: str = "llama-server"


class TRTLLMConfig(_Config):
    # The trtllm-serve of TensorRT-LLM's environment. The agent does not
    # install TensorRT-LLM, so a node offers the engine only when this is set.
    serve_path: str = ""
    # Multi-node replicas run as one MPI world started from the leader.
    mpirun_path: str = "mpirun"
    launch_path: str = "trtllm-llmapi-launch"


class MegatronConfig(_Config):
    torchrun_path: str = "torchrun"
    # The interpreter torchrun belongs to, for asking the server for its help.
    python: str = "python3"
    # A Megatron-LM checkout: `examples.inference` is not an installed package,
    # so it is put on PYTHONPATH. Empty relies on the environment.
    megatron_dir: str = ""


class SimConfig(_Config):
    # The interpreter llmgw runs in: the agent fills in sys.executable, so the
    # simulator runs the same llmgw as the agent.
    python_executable: str = "python3"


class EnginesConfig(_Config):
    # Engines this node never installs or advertises, whatever the control
    # plane asks: vLLM on a node whose cards no build of it runs on.
    disabled: tuple[str, ...] = ()
    vllm: VLLMConfig = VLLMConfig()
    sglang: SGLangConfig = SGLangConfig()
    llamacpp: LlamaCppConfig = LlamaCppConfig()
    trtllm: TRTLLMConfig = TRTLLMConfig()
    megatron: MegatronConfig = MegatronConfig()
    sim: SimConfig = SimConfig()
