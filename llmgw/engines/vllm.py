"""The vLLM adapter: `vllm serve`, on one node, natively across nodes, or under Ray.

Flags are the reference's (engines.md §1: vllm/engine/arg_utils.py,
entrypoints/openai/cli_args.py). This module must NOT guess the vLLM version:
version-dependent behaviour is a warning, not a branch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmgw.engines.command import Command
from llmgw.engines.config import VLLMConfig
from llmgw.engines.engine import Engine, LoadMetrics, Readiness, host_port
from llmgw.engines.env import materialize_env, shard_env
from llmgw.engines.flags import ReservedFlag, arg_sets_flag
from llmgw.engines.kv_config import kv_events_config
from llmgw.engines.spec import GPUInfo, Profile, ShardSpec
from llmgw.engines.validation import EngineTraits
from llmgw.errors import SpecError

__all__ = ["VLLM", "VLLM_LOAD_METRICS"]

_ALWAYS = (
    ReservedFlag(("--host",), "the agent's bind address (ShardSpec.bind_addr)"),
    ReservedFlag(("--port",), "the port the agent chooses (ShardSpec.http_port)"),
    ReservedFlag(("--uds",), "the agent's bind address (ShardSpec.bind_addr)"),
    ReservedFlag(("--model",), "profile.model_path"),
    ReservedFlag(("--served-model-name",), "profile.served_model_name"),
    ReservedFlag(("--tensor-parallel-size", "-tp"), "profile.tp"),
    ReservedFlag(("--pipeline-parallel-size", "-pp"), "profile.pp"),
    ReservedFlag(("--api-key",), "the shard's API key, which llmgw issues"),
    ReservedFlag(("--kv-events-config",), "profile.kv_events"),
    ReservedFlag(("--lora-modules",), "profile.adapters"),
    ReservedFlag(("--nnodes", "-n"), "profile.nodes"),
    ReservedFlag(("--node-rank", "-r"), "placement (ShardSpec.rank)"),
    ReservedFlag(("--master-addr",), "placement (ShardSpec.leader_addr)"),
    ReservedFlag(("--master-port",), "placement (ShardSpec.leader_port)"),
    ReservedFlag(("--headless",), "placement (ShardSpec.rank)"),
    ReservedFlag(("--distributed-executor-backend",), "profile.multinode_backend"),
    # A config file can set any flag above where no check sees it.
    ReservedFlag(("--config",), "profile.args (flags, one per element)"),
    # A data-parallel group spread over nodes needs per-node ranks, addresses
    # and RPC ports placement does not give; one node's group is
    # --data-parallel-size alone, counted into the shard's GPUs.
    ReservedFlag(
        ("--data-parallel-size-local", "-dpl"),
        "--data-parallel-size on one node, or more replicas",
    ),
    ReservedFlag(
        ("--data-parallel-start-rank", "-dpr"),
        "--data-parallel-size on one node, or more replicas",
    ),
    ReservedFlag(
        ("--data-parallel-address", "-dpa"),
        "--data-parallel-size on one node, or more replicas",
    ),
    ReservedFlag(
        ("--data-parallel-rpc-port", "-dpp"),
        "--data-parallel-size on one node, or more replicas",
    ),
)
_KV_EVENTS = (
    ReservedFlag(("--block-size",), "profile.kv_hash.block_size"),
    ReservedFlag(("--prefix-caching-hash-algo",), "profile.kv_hash.algorithm"),
    ReservedFlag(("--no-enable-prefix-caching",), "profile.kv_events (it needs the prefix cache)"),
)


# vLLM's gauges of its scheduler's requests (the simulator exports the same names).
VLLM_LOAD_METRICS = LoadMetrics(
    running=("vllm:num_requests_running",), waiting=("vllm:num_requests_waiting",)
)


class VLLM(Engine):
    traits = EngineTraits(
        name="vllm",
        multi_node=True,
        cpu=False,
        kv_events=True,
        dp_flags=("--data-parallel-size", "-dp"),
        quantization_flags=("--quantization", "-q"),
    )
    readiness = Readiness(loading_statuses=frozenset())
    load_metrics = VLLM_LOAD_METRICS
    all_reserved = (*_ALWAYS, *_KV_EVENTS)
    # Sleep mode (a profile's --enable-sleep-mode): level 1 moves the weights to host memory
    # and drops the KV cache (vLLM publishes AllBlocksCleared); "wait" lets requests already
    # running finish first instead of aborting them. A release without the mode parameter
    # ignores it. /wake_up brings everything back.
    suspend_calls = ("/sleep?level=1&mode=wait",)
    resume_calls = ("/wake_up",)

    def __init__(self, cfg: VLLMConfig | None = None) -> None:
        self._cfg = cfg or VLLMConfig()

    def reserved_flags(self, profile: Profile) -> list[ReservedFlag]:
        return [*_ALWAYS, *(_KV_EVENTS if profile.kv_events else ())]

    def _validate_engine(self, profile: Profile, gpus: Sequence[GPUInfo]) -> list[str]:
        if any(g.mig for g in gpus):
            return [
                f"profile {profile.name!r}: some vLLM releases (0.20.1, vllm#41848) crash on "
                f"CUDA_VISIBLE_DEVICES=MIG-<uuid>; check the build this node runs"
            ]
        return []

    def can_suspend(self, profile: Profile) -> bool:
        """Whether the profile's args turn vLLM's sleep mode on (the last spelling wins, as
        argparse's BooleanOptionalAction keeps it); without it an idle replica is stopped."""
        known = self.known_flags()
        on = False
        for arg in profile.args:
            if arg_sets_flag(arg, "--enable-sleep-mode", self.syntax, known):
                on = True
            elif arg_sets_flag(arg, "--no-enable-sleep-mode", self.syntax, known):
                on = False
        return on

    def use_installed(self, path: str) -> bool:
        self._cfg = self._cfg.model_copy(update={"path": path})
        return True

    def _server_args(self, spec: ShardSpec) -> list[str]:
        p = spec.profile
        args = [
            "serve",
            p.model_path,
            "--served-model-name",
            p.served_name,
            "--host",
            spec.host,
            "--port",
            str(spec.http_port),
            "--tensor-parallel-size",
            str(p.tp),
            "--pipeline-parallel-size",
            str(p.pp_degree),
        ]
        if p.adapters:
            # One flag with every adapter: vLLM's action replaces the list on a
            # repeated --lora-modules, so repeating it would keep only the last.
            args += ["--enable-lora", "--lora-modules", *(f"{a.name}={a.path}" for a in p.adapters)]
        if p.kv_events:
            # Every rank gets the cache layout (block size shapes the workers'
            # KV tensors); only the leader, whose scheduler owns the cache,
            # publishes events.
            args += [
                "--enable-prefix-caching",
                "--prefix-caching-hash-algo",
                p.kv_hash.algorithm,
                "--block-size",
                str(p.kv_hash.block_size),
            ]
            if spec.leader:
                args += ["--kv-events-config", kv_events_config(spec)]
        if spec.nnodes > 1 and p.multinode_backend == "native":
            args += [
                "--nnodes",
                str(spec.nnodes),
                "--node-rank",
                str(spec.rank),
                "--master-addr",
                spec.leader_addr,
                "--master-port",
                str(spec.leader_port),
            ]
            if not spec.leader:
                # Headless ranks run only workers against the leader's master port.
                args.append("--headless")
        elif spec.nnodes > 1:
            args += ["--distributed-executor-backend", "ray"]
        return [*args, *p.args]

    def _env(self, spec: ShardSpec, inherited: Mapping[str, str]) -> dict[str, str]:
        p = spec.profile
        extra: dict[str, str] = {}
        if spec.api_key:
            extra["VLLM_API_KEY"] = spec.api_key
        if p.kv_events:
            # Seeds NONE_HASH, the root of every block-hash chain. Unset, vLLM
            # <= 0.28 picks a random root per process (no replica would match the
            # router) and 0.29+ a fixed public default: set it explicitly either way.
            extra["PYTHONHASHSEED"] = p.kv_hash.seed
        if self.can_suspend(p):
            # vLLM serves /sleep and /wake_up only in its development mode, which also opens
            # other unauthenticated control routes (its --api-key guards /v1 alone). Safe
            # here because engines listen on loopback (agent.engine_bind_addr; off it only on
            # a trusted management network) and the shard's front door forwards /v1,
            # /tokenize, /health and /metrics only.
            extra["VLLM_SERVER_DEV_MODE"] = "1"
        if spec.nnodes > 1:
            # Without it Ray and vLLM may pick different NICs on a multi-NIC
            # node, and the placement group never fits.
            extra["VLLM_HOST_IP"] = self._node_addr(spec)
        return materialize_env(inherited, shard_env(spec, extra), spec)

    def _node_addr(self, spec: ShardSpec) -> str:
        if spec.node_addr:
            return spec.node_addr
        if spec.leader:
            return spec.leader_addr
        raise SpecError(
            f"shard {spec.shard_id}: rank {spec.rank} of a multi-node vLLM replica needs "
            f"node_addr, this node's management address; the agent sets it",
            field="node_addr",
        )

    def _commands(self, spec: ShardSpec, inherited: Mapping[str, str]) -> list[Command]:
        env = self._env(spec, inherited)
        if spec.nnodes == 1 or spec.profile.multinode_backend == "native":
            name = "vllm" if spec.leader else "vllm-headless"
            return [
                Command(
                    name=name, path=self._cfg.path, args=tuple(self._server_args(spec)), env=env
                )
            ]
        leader = host_port(spec.leader_addr, spec.leader_port)
        # Ray's workers inherit the raylet's environment, which is this
        # command's: the NCCL variables must be on `ray start`, not only on vLLM.
        # --node-ip-address, --disable-usage-stats and --block are `ray start`
        # flags beyond the reference's example (engines.md §1 shows --head,
        # --port, --address); check them with `ray start --help` in the image.
        ray_common = (
            "--node-ip-address",
            self._node_addr(spec),
            "--disable-usage-stats",
            "--block",
        )
        if spec.leader:
            head = Command(
                name="ray-head",
                path=self._cfg.ray_path,
                args=("start", "--head", f"--port={spec.leader_port}", *ray_common),
                env=env,
            )
            server = Command(
                name="vllm",
                path=self._cfg.path,
                args=tuple(self._server_args(spec)),
                env=env,
                wait_for_leader_port=True,
            )
            return [head, server]
        worker = Command(
            name="ray-worker",
            path=self._cfg.ray_path,
            args=("start", f"--address={leader}", *ray_common),
            env=env,
            wait_for_leader_port=True,
        )
        return [worker]
