"""The TensorRT-LLM adapter: `trtllm-serve`, on one node or as one MPI world across nodes.

Flags are the reference's (engines.md §4: tensorrt_llm/commands/serve.py, a
click command). TensorRT-LLM checks no API key (NVIDIA/TensorRT-LLM#9950), so
the engine says so (`authenticates = False`) and the agent keeps it on
loopback behind its proxy. This module must NOT offer the engine when no
trtllm-serve is configured: the agent does not install it.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping

from llmgw.engines.command import Command, CommandFile
from llmgw.engines.config import TRTLLMConfig
from llmgw.engines.engine import Engine, Readiness
from llmgw.engines.env import materialize_env, shard_env
from llmgw.engines.flags import ReservedFlag
from llmgw.engines.spec import Profile, ShardSpec
from llmgw.engines.validation import EngineTraits
from llmgw.errors import SpecError

__all__ = ["OPTIONS_FILE_NAME", "TRTLLM"]

OPTIONS_FILE_NAME = "trtllm-options.yaml"
_OPTIONS = ("--extra_llm_api_options", "--config")
_RESERVED = (
    ReservedFlag(("--host",), "the agent's bind address (ShardSpec.bind_addr)"),
    ReservedFlag(("--port",), "the port the agent chooses (ShardSpec.http_port)"),
    ReservedFlag(("--tp_size", "--tensor_parallel_size"), "profile.tp"),
    ReservedFlag(("--pp_size",), "profile.pp"),
    ReservedFlag(("--gpus_per_node",), "profile.gpus_per_node"),
)


class TRTLLM(Engine):
    traits = EngineTraits(name="trtllm", multi_node=True, cpu=False, kv_events=False)
    display_name = "TensorRT-LLM"
    # uvicorn serves only after the LLM is built: loading is a refused
    # connection (or a hang), never a status code.
    readiness = Readiness(loading_statuses=frozenset())
    all_reserved = (*_RESERVED, ReservedFlag(_OPTIONS, "profile.adapters"))
    authenticates = False
    # mpirun -x copies the leader's CUDA_VISIBLE_DEVICES and NCCL_IB_HCA to
    # every rank (see _commands): placement gives every node the same ones.
    uniform_ranks = True

    def __init__(self, cfg: TRTLLMConfig | None = None) -> None:
        self._cfg = cfg or TRTLLMConfig()

    @property
    def offered(self) -> bool:
        return bool(self._cfg.serve_path)

    def reserved_flags(self, profile: Profile) -> list[ReservedFlag]:
        out = list(_RESERVED)
        if profile.adapters:
            # The adapters go into llmgw's options file, and there is one.
            out.append(ReservedFlag(_OPTIONS, "profile.adapters (llmgw writes the options file)"))
        return out

    def use_installed(self, path: str) -> bool:
        self._cfg = self._cfg.model_copy(update={"serve_path": path})
        return True

    def serves_http(self, spec: ShardSpec) -> bool:
        return spec.leader

    def _serve_args(self, spec: ShardSpec) -> tuple[list[str], tuple[CommandFile, ...]]:
        p = spec.profile
        # No --served_model_name in the version the reference read (newer
        # builds seem to have one [unverified]); the gateway maps names.
        args = [
            p.model_path,
            "--host",
            spec.host,
            "--port",
            str(spec.http_port),
            "--tp_size",
            str(p.tp),
            "--pp_size",
            str(p.pp_degree),
            "--gpus_per_node",
            str(p.per_node),
        ]
        files: tuple[CommandFile, ...] = ()
        if p.adapters:
            path = (
                posixpath.join(spec.runtime_dir, OPTIONS_FILE_NAME)
                if spec.runtime_dir
                else OPTIONS_FILE_NAME
            )
            dirs = "".join(f"    - {json.dumps(a.path)}\n" for a in p.adapters)
            content = f"lora_config:\n  lora_dir:\n{dirs}"
            files = (CommandFile(path=path, mode=0o600, content=content, secret=False),)
            args += ["--extra_llm_api_options", path]
        return [*args, *p.args], files

    def _commands(self, spec: ShardSpec, inherited: Mapping[str, str]) -> list[Command]:
        if not self.offered:
            raise SpecError(
                f"shard {spec.shard_id}: engine trtllm is not offered on this node; set "
                f"engines.trtllm.serve_path to TensorRT-LLM's trtllm-serve",
                field="profile.engine",
            )
        p = spec.profile
        serve_args, files = self._serve_args(spec)
        generated = shard_env(spec)
        env = materialize_env(inherited, generated, spec)
        if spec.nnodes == 1:
            return [
                Command(
                    name="trtllm-serve",
                    path=self._cfg.serve_path,
                    args=tuple(serve_args),
                    env=env,
                    files=files,
                )
            ]
        if not spec.leader:
            # The leader's mpirun starts this node's ranks over ssh; the shard
            # holds its GPUs and supervises nothing.
            return []
        if len(spec.peer_addrs) != spec.nnodes:
            raise SpecError(
                f"shard {spec.shard_id}: a {spec.nnodes}-node trtllm replica needs peer_addrs "
                f"for every rank, got {len(spec.peer_addrs)}",
                field="peer_addrs",
            )
        hosts = ",".join(f"{a}:{p.per_node}" for a in spec.peer_addrs)
        # -x exports the leader's values to every rank, so every node must have
        # the leader's GPU indices, HCA and interface names: placement honours
        # it (PlacementRequirements.same_gpu_indices_across_nodes) and
        # check_replica_specs refuses a replica that breaks it. Only generated
        # and profile variables are exported, not the agent's whole environment.
        exports = [arg for name in sorted(generated) for arg in ("-x", name)]
        args = (
            "-np",
            str(p.tp * p.pp_degree),
            "--host",
            hosts,
            *exports,
            self._cfg.launch_path,
            self._cfg.serve_path,
            *serve_args,
        )
        return [Command(name="mpirun", path=self._cfg.mpirun_path, args=args, env=env, files=files)]
