"""The llama.cpp adapter: `llama-server`, one process on one node, on GPUs or CPU cores.

Flags are the reference's (engines.md §3: tools/server/README.md). This module
must NOT decide whether a build really uses its GPUs: it says how to ask
(`list_devices_command`) and how to read the answer (`listed_devices`) and the log
(`cpu_fallback_in_log`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmgw.engines.command import Command
from llmgw.engines.config import LlamaCppConfig
from llmgw.engines.engine import Engine, LoadMetrics, Readiness
from llmgw.engines.env import materialize_env, shard_env
from llmgw.engines.flags import ReservedFlag, has_flag
from llmgw.engines.spec import GPUInfo, Profile, ShardSpec
from llmgw.engines.validation import EngineTraits
from llmgw.errors import SpecError

__all__ = ["LlamaCpp"]

# What a build without a GPU backend logs before serving on the CPU anyway.
_CPU_FALLBACK_LOG_MARKERS = ("not compiled with GPU offload support",)

_GPU_LAYERS = ("--n-gpu-layers", "-ngl", "--gpu-layers")
_THREADS = ("--threads", "-t")
_RESERVED = (
    ReservedFlag(("--host",), "the agent's bind address (ShardSpec.bind_addr)"),
    ReservedFlag(("--port",), "the port the agent chooses (ShardSpec.http_port)"),
    ReservedFlag(("--model", "-m"), "profile.model_path"),
    ReservedFlag(("--alias", "-a"), "profile.served_model_name"),
    ReservedFlag(("--api-key",), "the shard's API key, which llmgw issues"),
    ReservedFlag(("--api-key-file",), "the shard's API key, which llmgw issues"),
    ReservedFlag(("--lora",), "profile.adapters"),
    ReservedFlag(("--lora-scaled",), "profile.adapters"),
    # RPC backends are llama.cpp's only way across nodes, which placement
    # never gives it.
    ReservedFlag(("--rpc",), "another engine for multi-node replicas"),
    # The devices are CUDA_VISIBLE_DEVICES, renumbered from 0.
    ReservedFlag(("--device", "-dev"), "placement (ShardSpec.gpu_indices)"),
)


class LlamaCpp(Engine):
    traits = EngineTraits(name="llamacpp", multi_node=False, cpu=True, kv_events=False)
    display_name = "llama.cpp"
    # 503 {"message": "Loading model"} while loading, 200 once ready.
    readiness = Readiness(loading_statuses=frozenset({503}))
    # Slots busy and requests deferred for want of one (as llama-server exposes them with
    # --metrics, which this adapter passes).
    load_metrics = LoadMetrics(
        running=("llamacpp:requests_processing",), waiting=("llamacpp:requests_deferred",)
    )
    all_reserved = (
        *_RESERVED,
        ReservedFlag(_GPU_LAYERS, "a GPU class"),
        ReservedFlag(_THREADS, "profile.threads"),
    )
    falls_back_to_cpu = True
    tokenizer_flags = ()

    def __init__(self, cfg: LlamaCppConfig | None = None) -> None:
        self._cfg = cfg or LlamaCppConfig()

    def tokenizer_dir(self, profile: Profile) -> str | None:
        # llama-server reads its vocabulary and chat template from the GGUF file itself, which
        # is no tokenizer.json: only a profile's `tokenizer:` directory gives the gateways one.
        return None

    def reserved_flags(self, profile: Profile) -> list[ReservedFlag]:
        out = list(_RESERVED)
        if profile.cpu_only:
            out.append(ReservedFlag(_GPU_LAYERS, "a GPU class (a CPU profile offloads nothing)"))
        if profile.cpu_only or profile.threads > 0:
            out.append(ReservedFlag(_THREADS, "profile.threads"))
        return out

    def _validate_engine(self, profile: Profile, gpus: Sequence[GPUInfo]) -> list[str]:
        for a in profile.adapters:
            # Newer builds split --lora values at commas.
            if "," in a.path:
                raise SpecError(
                    f"profile {profile.name!r}: adapter {a.name!r} path {a.path!r} contains ',', "
                    f"which llama-server splits on; rename the file",
                    field="profile.adapters",
                )
        return []

    def use_installed(self, path: str) -> bool:
        self._cfg = self._cfg.model_copy(update={"path": path})
        return True

    def cpu_fallback_in_log(self, log: str) -> str:
        return next((m for m in _CPU_FALLBACK_LOG_MARKERS if m in log), "")

    def list_devices_command(self, command: Command) -> tuple[str, tuple[str, ...]] | None:
        return command.path, ("--list-devices",)

    def listed_devices(self, output: str) -> list[str]:
        # "Available devices:", then one indented line per device.
        return [
            line.strip()
            for line in output.splitlines()
            if line.startswith((" ", "\t")) and line.strip()
        ]

    def _commands(self, spec: ShardSpec, inherited: Mapping[str, str]) -> list[Command]:
        p = spec.profile
        args = [
            "--model",
            p.model_path,
            "--alias",
            p.served_name,
            "--host",
            spec.host,
            # Always given: the default moved from 8080 to 9931 between builds.
            "--port",
            str(spec.http_port),
            "--metrics",
        ]
        if p.cpu_only:
            # CUDA_VISIBLE_DEVICES is empty as well, so a CUDA build cannot
            # reach for a GPU another shard holds.
            args += ["-ngl", "0"]
        elif not has_flag(p.args, _GPU_LAYERS, self.syntax):
            # Every layer on the GPUs unless the profile offloads fewer; a
            # number rather than "all", which older builds do not accept.
            args += ["-ngl", "999"]
        if spec.num_threads > 0 and not has_flag(p.args, _THREADS, self.syntax):
            args += ["--threads", str(spec.num_threads)]
        for a in p.adapters:
            # Repeated rather than comma-joined: older builds take one path per
            # flag, newer ones append either way. The order is the adapter id.
            args += ["--lora", a.path]
        args += p.args
        extra = {"LLAMA_API_KEY": spec.api_key} if spec.api_key else {}
        env = materialize_env(inherited, shard_env(spec, extra), spec)
        return [Command(name="llama-server", path=self._cfg.path, args=tuple(args), env=env)]
