"""The checks every engine applies to a profile before anything is started.

A profile that cannot work should fail when it is defined, with a message an
operator can act on, rather than as an engine that hangs or crash-loops on
every node it is placed on. Every error names the profile, the rule and the
numbers.

This module must NOT know engine specifics beyond what adapters pass in (their
traits and the flag names they read): adapters own their flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.engines.env import unsafe_env_reason
from llmgw.engines.flags import FlagSyntax, flag_value, has_flag, syntax_for
from llmgw.engines.spec import GPUInfo, Profile
from llmgw.errors import SpecError

__all__ = [
    "EngineTraits",
    "data_parallel_size",
    "gpus_per_shard",
    "validate_common",
    "validate_spec_fits",
]


@dataclass(frozen=True, slots=True)
class EngineTraits:
    """What an engine can do, as far as validation cares."""

    name: str
    multi_node: bool
    cpu: bool
    kv_events: bool
    # Flags that set data parallelism, whose size multiplies the GPUs and,
    # for vLLM, shifts KV event ports per rank.
    dp_flags: tuple[str, ...] = ()
    # Flags that put the DP ranks inside the TP group instead (SGLang's DP
    # attention): data parallelism then needs no GPUs of its own.
    dp_within_tp_flags: tuple[str, ...] = ()
    quantization_flags: tuple[str, ...] = ("--quantization",)
    dtype_flags: tuple[str, ...] = ("--dtype",)
    # Flags that switch the model to bf16 on their own (Megatron's --bf16).
    bf16_flags: tuple[str, ...] = ()

    @property
    def syntax(self) -> FlagSyntax:
        return syntax_for(self.name)


@dataclass(frozen=True, slots=True)
class _Requirement:
    feature: str
    min_cc: tuple[int, int]
    # Below min_cc but at or above this the engine degrades instead of failing
    # (FP8 becomes Marlin weight-only): a warning, not an error.
    degrades_from: tuple[int, int] | None = None


_FP8 = _Requirement("FP8 W8A8", (8, 9), degrades_from=(8, 0))
_MARLIN = _Requirement("Marlin kernels", (8, 0))
# The reference's §7 table (vLLM's supported-hardware page, SGLang's server args).
_QUANTIZATION: dict[str, _Requirement] = {
    "fp8": _FP8,
    "fbgemm_fp8": _FP8,
    "w8a8_fp8": _FP8,
    "awq": _Requirement("AWQ", (7, 5)),
    "gptq": _Requirement("GPTQ", (7, 0)),
    "awq_marlin": _MARLIN,
    "gptq_marlin": _MARLIN,
    "gptq_marlin_24": _MARLIN,
    "marlin": _MARLIN,
    "w8a8_int8": _Requirement("INT8 W8A8", (7, 5)),
    "bitsandbytes": _Requirement("bitsandbytes", (7, 0)),
    "gguf": _Requirement("GGUF", (7, 0)),
}
_BF16 = _Requirement("bf16", (8, 0))


def _fail(profile: Profile, message: str, field: str) -> SpecError:
    return SpecError(f"profile {profile.name!r}: {message}", field=f"profile.{field}")


def _parse_cc(text: str) -> tuple[int, int] | None:
    major, _, minor = text.strip().partition(".")
    try:
        return int(major), int(minor or "0")
    except ValueError:
        return None


def _cc_text(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def _check_capability(
    profile: Profile, gpus: Sequence[GPUInfo], req: _Requirement, what: str, warnings: list[str]
) -> None:
    for g in gpus:
        cc = _parse_cc(g.compute_capability)
        if cc is None or cc >= req.min_cc:
            # An unparsable capability lets the launch through: the engine
            # refuses clearly enough, and a parsing problem must not block it.
            continue
        if req.degrades_from is not None and cc >= req.degrades_from:
            warnings.append(
                f"profile {profile.name!r}: {what} runs natively from compute capability "
                f"{_cc_text(req.min_cc)}; GPU {g.index} ({g.name}) has {g.compute_capability}, "
                f"so the engine silently falls back to a slower weight-only kernel"
            )
            return
        raise _fail(
            profile,
            f"{what} ({req.feature}) needs compute capability {_cc_text(req.min_cc)} or newer, "
            f"GPU {g.index} ({g.name}) has {g.compute_capability}; use a newer GPU class "
            f"or another {what.split()[0]}",
            "args",
        )


def data_parallel_size(profile: Profile, traits: EngineTraits) -> int:
    """The data-parallel degree the profile's args give the engine (1 when none).

    Read in every spelling the engine's parser takes (`--data-parallel-si 2`
    under argparse): a spelling missed here is a shard placed on a quarter of
    the GPUs it starts on, crash-looping (issue 8 item 11).
    """
    if not traits.dp_flags:
        return 1
    text = flag_value(profile.args, traits.dp_flags, traits.syntax)
    if text is None or text.strip() == "":
        return 1
    try:
        dp = int(text.strip())
    except ValueError:
        raise _fail(
            profile,
            f"data-parallel size {text!r} is not an integer; give {traits.dp_flags[0]} a "
            f"whole number of ranks",
            "args",
        ) from None
    if dp < 1:
        raise _fail(profile, f"data-parallel size {dp} must be 1 or more", "args")
    return dp


def _dp_gpu_factor(profile: Profile, traits: EngineTraits) -> int:
    dp = data_parallel_size(profile, traits)
    if (
        dp > 1
        and traits.dp_within_tp_flags
        and has_flag(profile.args, traits.dp_within_tp_flags, traits.syntax)
    ):
        return 1
    return dp


def gpus_per_shard(profile: Profile, traits: EngineTraits) -> int:
    """The GPUs one shard holds: gpus_per_node, or TP x PP x DP on one node; 0 on CPU."""
    if profile.cpu_only:
        return 0
    if profile.gpus_per_node > 0:
        return profile.gpus_per_node
    return profile.tp * profile.pp_degree * _dp_gpu_factor(profile, traits)


def _check_parallelism(profile: Profile, traits: EngineTraits) -> None:
    if profile.tp <= 0:
        raise _fail(profile, f"tp is {profile.tp}; tensor parallel degree must be 1 or more", "tp")
    if profile.pp < 0 or profile.nodes < 0 or profile.gpus_per_node < 0:
        raise _fail(profile, "pp, nodes and gpus_per_node may not be negative", "pp")
    nodes = profile.num_nodes
    if nodes > 1 and profile.gpus_per_node <= 0:
        raise _fail(
            profile,
            f"gpus_per_node is required for a {nodes}-node profile; set it to the GPUs "
            f"each node gives the replica",
            "gpus_per_node",
        )
    factor = _dp_gpu_factor(profile, traits)
    if factor > 1 and nodes > 1:
        # A DP group across nodes needs per-node ranks, addresses and RPC ports
        # that placement does not hand out: replicas are llmgw's data parallelism.
        raise _fail(
            profile,
            f"data parallelism {factor} across {nodes} nodes is refused: llmgw places a "
            f"data-parallel group on one node; use nodes 1, or more replicas instead",
            "args",
        )
    world = profile.tp * profile.pp_degree * factor
    # A CPU profile's one process stands for its one "GPU" here; _check_cpu
    # holds it to TP = PP = 1.
    per_node = profile.gpus_per_node if profile.gpus_per_node > 0 else world
    if per_node * nodes != world:
        dp_text = f" x DP {factor}" if factor > 1 else ""
        raise _fail(
            profile,
            f"{nodes} nodes x {per_node} GPUs = {per_node * nodes} does not "
            f"match TP {profile.tp} x PP {profile.pp_degree}{dp_text} = {world}",
            "gpus_per_node",
        )
    if nodes > 1 and not traits.multi_node:
        raise _fail(
            profile,
            f"engine {traits.name} runs on one node only, nodes is {nodes}; set nodes to 1",
            "nodes",
        )


def _check_cpu(profile: Profile, traits: EngineTraits) -> None:
    if not traits.cpu:
        raise _fail(
            profile,
            f"gpu_class is {profile.gpu_class!r} but engine {traits.name} does not run on "
            f"CPU alone; use llamacpp or vllm, or a GPU class",
            "gpu_class",
        )
    if profile.tp != 1 or profile.pp_degree != 1 or profile.num_nodes != 1:
        raise _fail(
            profile,
            f"a CPU profile runs as one process on one node; TP {profile.tp}, "
            f"PP {profile.pp_degree}, nodes {profile.num_nodes} must all be 1",
            "tp",
        )


def _check_gpus(profile: Profile, gpus: Sequence[GPUInfo], traits: EngineTraits) -> list[str]:
    warnings: list[str] = []
    if not gpus:
        return warnings
    need = gpus_per_shard(profile, traits)
    if len(gpus) < need:
        raise _fail(
            profile,
            f"needs {need} GPUs per node, the node has {len(gpus)}",
            "gpus_per_node",
        )
    # A tensor-parallel group must be uniform: the slowest card sets the pace
    # of every collective, and the smallest decides what fits.
    first = gpus[0]
    for g in gpus[1:]:
        if g.name != first.name:
            raise _fail(
                profile,
                f"GPUs are not uniform (GPU {first.index} is {first.name!r}, GPU {g.index} is "
                f"{g.name!r}); a tensor-parallel group may not mix GPU types",
                "gpu_class",
            )
    # One CUDA process enumerates one MIG instance, and NCCL has no P2P across
    # instances: a slice holds a whole TP = PP = 1 replica or nothing.
    if any(g.mig for g in gpus) and need > 1:
        dp = _dp_gpu_factor(profile, traits)
        raise _fail(
            profile,
            f"MIG instances run TP = PP = 1 only, the profile has TP {profile.tp} x "
            f"PP {profile.pp_degree}{f' x DP {dp}' if dp > 1 else ''}; use whole GPUs or a "
            f"single-GPU profile",
            "tp",
        )
    quant = flag_value(profile.args, traits.quantization_flags, traits.syntax)
    if quant is not None and quant.lower() in _QUANTIZATION:
        _check_capability(
            profile, gpus, _QUANTIZATION[quant.lower()], f"quantization {quant!r}", warnings
        )
    dtype = flag_value(profile.args, traits.dtype_flags, traits.syntax)
    if (dtype is not None and dtype.lower() in ("bfloat16", "bf16")) or has_flag(
        profile.args, traits.bf16_flags, traits.syntax
    ):
        _check_capability(profile, gpus, _BF16, "dtype bf16", warnings)
    return warnings


def _check_env(profile: Profile) -> None:
    for name, value in sorted(profile.env.items()):
        if "\0" in value:
            # exec refuses it, and the shard would crash-loop on every start.
            raise _fail(profile, f"env {name} holds a NUL character", "env")
    for field, names in (("env", profile.env), ("secret_env", profile.secret_env)):
        for name in sorted(names):
            why = unsafe_env_reason(name)
            if why is not None:
                raise _fail(
                    profile,
                    f"{field} may not set {name}: {why}; remove it (set node-wide "
                    f"variables in the agent's environment instead)",
                    field,
                )


def _check_kv_events(profile: Profile, traits: EngineTraits) -> None:
    if not profile.kv_events:
        return
    if not traits.kv_events:
        raise _fail(
            profile,
            f"kv_events is on but engine {traits.name} publishes no KV events llmgw can "
            f"read; turn kv_events off or use vllm",
            "kv_events",
        )
    seed = profile.kv_hash.seed
    if seed in ("", "0"):
        # Empty: vLLM 0.10.2-0.28 (and xxhash in every version) pick a random root
        # hash per process, so no two replicas (nor a replica and the router) agree
        # on any block; 0.29+ fall back to one public default seed for every cluster.
        # "0" also switches off Python's string-hash randomization in the engine.
        raise _fail(
            profile,
            f"kv_events needs kv_hash.seed, a random integer (1 to 2**32-1) shared by the "
            f"cluster; got "
            f'{seed!r} (empty and "0" are refused)',
            "kv_hash.seed",
        )
    dp = data_parallel_size(profile, traits)
    if dp > 1:
        # vLLM adds the DP rank to both event ports, so ranks above 0 would
        # publish where the agent is not listening.
        raise _fail(
            profile,
            f"data parallelism {dp} with kv_events is refused: each DP rank publishes on "
            f"its own shifted port; drop the data-parallel flag or turn kv_events off",
            "args",
        )


def _check_adapters(profile: Profile) -> None:
    seen: set[str] = set()
    for a in profile.adapters:
        if a.name in seen:
            raise _fail(profile, f"adapter name {a.name!r} appears twice", "adapters")
        seen.add(a.name)
        # name=path is how engines take adapters on the command line.
        if "=" in a.name or "," in a.name or a.name.startswith("-"):
            raise _fail(
                profile,
                f"adapter name {a.name!r} may not contain '=' or ',' or start with '-'",
                "adapters",
            )


def validate_common(profile: Profile, gpus: Sequence[GPUInfo], traits: EngineTraits) -> list[str]:
    """Raise SpecError if the profile cannot work on these GPUs; return warnings."""
    if not profile.model_path:
        raise _fail(profile, "model_path is empty; set it to the model's path or id", "model_path")

    for i, arg in enumerate(profile.args):
        if "\0" in arg:
            raise _fail(profile, f"args[{i}] holds a NUL character, which exec refuses", "args")
    _check_parallelism(profile, traits)
    warnings: list[str] = []
    if profile.cpu_only:
        _check_cpu(profile, traits)
    else:
        warnings.extend(_check_gpus(profile, gpus, traits))
    _check_env(profile)
    _check_kv_events(profile, traits)
    _check_adapters(profile)
    return warnings


def validate_spec_fits(
    profile: Profile, traits: EngineTraits, *, rank: int, nnodes: int, num_gpus: int
) -> None:
    """Refuse a shard spec that contradicts its own profile, before building commands."""
    if nnodes != profile.num_nodes:
        raise _fail(
            profile,
            f"shard spec has nnodes {nnodes} but the profile spans {profile.num_nodes} nodes",
            "nodes",
        )
    if rank >= nnodes:
        raise _fail(profile, f"shard rank {rank} is not below nnodes {nnodes}", "nodes")
    want = gpus_per_shard(profile, traits)
    if num_gpus != want:
        raise _fail(
            profile,
            f"shard spec gives {num_gpus} GPUs but the profile needs {want} per node",
            "gpus_per_node",
        )
