"""adapter_slots (issue [lora]): the flags each engine that loads adapters at runtime gets, the
profiles refused (naming the fix), and slots 0 leaving every command and fingerprint alone."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.engines import Adapter, Profile, profile_fingerprint
from llmgw.engines.runtime_adapters import SGLANG_RUNTIME_ADAPTERS, VLLM_RUNTIME_ADAPTERS
from llmgw.errors import SpecError
from tests.engines.engines_testkit import build, profile, registry, spec

SGLANG_SHAPE = ("--max-lora-rank", "64", "--lora-target-modules", "all")


def _args(**kw: Any) -> list[str]:
    [c] = build(spec(profile(**kw)))
    return list(c.args)


def _refused(**kw: Any) -> str:
    p = profile(**kw)
    eng = registry().get(p.engine)
    with pytest.raises(SpecError) as at_definition:
        eng.validate(p)
    # A spec stored before the rule, or sent by anything, is refused at launch too.
    with pytest.raises(SpecError) as at_launch:
        eng.commands(spec(p), base_env={})
    assert at_definition.value.message == at_launch.value.message
    assert at_definition.value.field in ("profile.adapter_slots", "profile.args")
    return at_definition.value.message


# --- which engines load at runtime ----------------------------------------------------


def test_vllm_sglang_and_the_simulator_load_adapters_at_runtime_the_others_do_not() -> None:
    reg = registry()
    assert reg.get("vllm").runtime_adapters is VLLM_RUNTIME_ADAPTERS
    assert reg.get("sim").runtime_adapters is VLLM_RUNTIME_ADAPTERS
    assert reg.get("sglang").runtime_adapters is SGLANG_RUNTIME_ADAPTERS
    for name in ("llamacpp", "trtllm", "megatron"):
        assert not reg.get(name).loads_adapters_at_runtime, name


@pytest.mark.parametrize(
    ("fields", "title"),
    [
        ({"engine": "llamacpp", "gpu_class": "cpu", "model_path": "/m/q4.gguf"}, "llama.cpp"),
        ({"engine": "trtllm"}, "TensorRT-LLM"),
        ({"engine": "megatron"}, "Megatron-core"),
    ],
)
def test_engines_that_cannot_load_at_runtime_refuse_slots_naming_the_fix(
    fields: dict[str, Any], title: str
) -> None:
    message = _refused(adapter_slots=2, **fields)
    assert message == (
        f"profile 'llama-h100': {title} cannot load adapters at runtime (adapter_slots is 2): "
        f"set adapter_slots to 0 and list the adapter in the profile's adapters"
    )


# --- vLLM -------------------------------------------------------------------------------


def test_vllm_slots_turn_lora_and_runtime_updating_on_with_the_two_sizes() -> None:
    [c] = build(spec(profile(adapter_slots=8), api_key="sk-shard-key-123456"))
    assert list(c.args[-5:]) == ["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "8"]
    assert c.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # Fewer slots than the batch default: a batch mixes at most what is held.
    assert _args(adapter_slots=2)[-4:] == ["--max-loras", "2", "--max-cpu-loras", "2"]


def test_vllm_slots_with_the_profiles_own_adapters_enable_lora_once() -> None:
    args = _args(adapter_slots=3, adapters=[Adapter(name="a", path="/l/a")])
    assert args.count("--enable-lora") == 1
    assert args[-7:] == [
        "--enable-lora", "--lora-modules", "a=/l/a", "--max-loras", "3", "--max-cpu-loras", "3",
    ]  # fmt: skip


def test_vllm_args_may_size_the_batch_and_repeat_the_held_size_and_lora_switch() -> None:
    args = _args(adapter_slots=8, args=["--enable-lora", "--max-loras", "2", "--max-cpu-loras=8"])
    # Nothing the args say is said twice.
    assert args.count("--enable-lora") == 1
    assert "--max-loras" not in args[:-4] and "--max-cpu-loras" not in args
    assert args[-4:] == ["--enable-lora", "--max-loras", "2", "--max-cpu-loras=8"]


def test_vllm_max_cpu_loras_other_than_the_slots_is_refused_naming_both() -> None:
    message = _refused(adapter_slots=8, args=["--max-cpu-loras", "4"])
    assert message == (
        "profile 'llama-h100': args set --max-cpu-loras 4, but adapter_slots 8 makes vLLM hold "
        "8 adapters (--max-cpu-loras 8); remove --max-cpu-loras from args and size it with "
        "adapter_slots"
    )
    # Under any spelling vLLM's parser takes.
    assert "--max-cpu-loras 4" in _refused(adapter_slots=8, args=["--max_cpu_loras=4"])
    assert "not a whole number" in _refused(adapter_slots=8, args=["--max-cpu-loras", "x"])


def test_vllm_a_batch_larger_than_the_slots_is_refused() -> None:
    message = _refused(adapter_slots=2, args=["--max-loras", "16"])
    assert "--max-loras 16" in message and "adapter_slots 2" in message


def test_vllm_runtime_updating_needs_one_api_server() -> None:
    message = _refused(adapter_slots=4, args=["--api-server-count", "2"])
    assert message == (
        "profile 'llama-h100': adapter_slots is 4, and vLLM loads adapters at runtime "
        "(VLLM_ALLOW_RUNTIME_LORA_UPDATING) with one API server only, but args set "
        "--api-server-count 2; set it to 1 (or remove it), or set adapter_slots to 0"
    )
    assert "--api-server-count 3" in _refused(adapter_slots=4, args=["-asc", "3"])
    # Data parallelism would start one API server per rank: the leader is given one.
    dp = _args(adapter_slots=4, args=["--data-parallel-size", "2"], tp=1, gpus_per_node=2)
    assert dp[dp.index("--api-server-count") + 1] == "1"
    assert "--api-server-count" not in _args(adapter_slots=4)


def test_vllm_args_that_turn_lora_off_are_refused() -> None:
    message = _refused(adapter_slots=4, args=["--enable-lora", "--no-enable-lora"])
    assert "args turn LoRA off (--no-enable-lora)" in message
    assert "--enable-lora" in _args(adapter_slots=4, args=["--no-enable-lora", "--enable-lora"])


def test_vllm_every_rank_gets_the_sizes_and_only_the_leader_one_api_server() -> None:
    p = profile(adapter_slots=4, tp=16, nodes=2, gpus_per_node=8, multinode_backend="native")
    kw: dict[str, Any] = {"nnodes": 2, "leader_addr": "10.0.0.1", "leader_port": 29500}
    for rank in (0, 1):
        [c] = build(spec(p, rank=rank, node_addr=f"10.0.0.{rank + 1}", **kw))
        assert "--max-cpu-loras" in c.args and "--enable-lora" in c.args
        assert "--api-server-count" not in c.args


# --- the simulator --------------------------------------------------------------------


def test_sim_slots_are_vllms_flags_and_variable() -> None:
    p = profile(engine="sim", gpu_class="cpu", model_path="sim://m", adapter_slots=6)
    [c] = build(spec(p))
    i = c.args.index("--max-loras")
    assert list(c.args[i : i + 4]) == ["--max-loras", "4", "--max-cpu-loras", "6"]
    assert "--enable-lora" not in c.args  # the simulator's LoRA is always on
    assert c.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    message = _refused(
        engine="sim", gpu_class="cpu", model_path="sim://m", adapter_slots=6,
        args=["--max-cpu-loras", "2"],
    )  # fmt: skip
    assert "args set --max-cpu-loras 2, but adapter_slots 6 makes the simulator hold 6" in message


# --- SGLang -----------------------------------------------------------------------------


def test_sglang_slots_enable_lora_with_its_sizes() -> None:
    args = _args(engine="sglang", adapter_slots=8, args=list(SGLANG_SHAPE))
    i = args.index("--enable-lora")
    assert args[i:] == [
        "--enable-lora", "--max-loras-per-batch", "4", "--max-loaded-loras", "8", *SGLANG_SHAPE,
    ]  # fmt: skip
    [c] = build(spec(profile(engine="sglang", adapter_slots=8, args=list(SGLANG_SHAPE))))
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in c.env


def test_sglang_counts_the_profiles_own_adapters_against_what_it_holds() -> None:
    own = [Adapter(name="a", path="/l/a"), Adapter(name="b", path="/l/b")]
    # Its --lora-paths size the memory pool: no rank or modules needed.
    args = _args(engine="sglang", adapter_slots=3, adapters=own)
    assert args.count("--enable-lora") == 1
    assert args[-4:] == ["--max-loras-per-batch", "4", "--max-loaded-loras", "5"]


def test_sglang_without_its_own_adapters_needs_the_lora_shape_in_args() -> None:
    message = _refused(engine="sglang", adapter_slots=2, args=["--max-lora-rank", "16"])
    assert message == (
        "profile 'llama-h100': adapter_slots is 2 and the profile lists no adapters, so SGLang "
        "sizes its LoRA memory at start from --max-lora-rank and --lora-target-modules, and "
        "refuses to start without them; add --lora-target-modules to args (e.g. --max-lora-rank "
        "64 --lora-target-modules all: the largest rank and the modules of every adapter it "
        "will load)"
    )
    message = _refused(
        engine="sglang", adapter_slots=2, args=[*SGLANG_SHAPE, "--max-loaded-loras", "9"]
    )
    assert "--max-loaded-loras 9" in message and "(--max-loaded-loras 2)" in message


# --- slots 0 ----------------------------------------------------------------------------

# Fingerprints computed by the engines package as it was before adapter_slots existed (git
# HEAD of the [lora] work, same profiles without the field): slots 0 must roll no replica.
_BEFORE_SLOTS: dict[str, tuple[dict[str, Any], str]] = {
    "vllm": (
        {"engine": "vllm", "gpu_class": "h100", "model_path": "/models/m", "tp": 2},
        "bceae52cbdfc614c7a0e5fb9d8c3b2a5bcb630e579fe108c2214e0384aea1fe1",
    ),
    "vllm-kv-lora": (
        {
            "engine": "vllm", "gpu_class": "h100", "model_path": "/models/m", "kv_events": True,
            "kv_hash": {"seed": "3054198966", "block_size": 16},
            "adapters": [{"name": "a", "path": "/l/a"}], "args": ["--max-loras", "2"],
        },
        "e52cd6aa6bd5fdcab161f12f5fb185756ba9c26446e6a71b8ca203978849d4f9",
    ),
    "vllm-cpu": (
        {"engine": "vllm", "gpu_class": "cpu", "model_path": "/models/m", "threads": 4},
        "d4edf5a9c1ca690f69094ae560ac972cb0701683569f5c53d6f00301d18f0514",
    ),
    "sglang": (
        {
            "engine": "sglang", "gpu_class": "h100", "model_path": "/models/m",
            "adapters": [{"name": "a", "path": "/l/a"}],
        },
        "87ca61131ff89a9cc7c8ffa6b213646042ae352bec7a2637cc74450907e8704a",
    ),
    "llamacpp": (
        {"engine": "llamacpp", "gpu_class": "cpu", "model_path": "/models/m.gguf"},
        "3550c0a0d824a38ea70c47bcdd318b0e370df74e4a791c3ceed29b5862866357",
    ),
    "trtllm": (
        {"engine": "trtllm", "gpu_class": "h100", "model_path": "/models/m", "tp": 2},
        "24aa9da5d777bfbe9b7f31656d7c3cd941ab9387036b2c983317211c749ba138",
    ),
    "megatron": (
        {"engine": "megatron", "gpu_class": "h100", "model_path": "/models/m"},
        "41b3b578e316e118056e59ff4d1ce41f55b0a1764d0aa5e255b10aa9ac0afdc3",
    ),
    "sim": (
        {
            "engine": "sim", "gpu_class": "cpu", "model_path": "sim://m", "kv_events": True,
            "kv_hash": {"seed": "3054198966", "block_size": 16},
        },
        "5b034690aeb2c794609487580d0b6bd5b58594cf13daf0984adfd2a45b303ef5",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_BEFORE_SLOTS))
def test_slots_0_leave_every_fingerprint_as_it_was(case: str) -> None:
    fields, before = _BEFORE_SLOTS[case]
    p = Profile.model_validate({"name": "p", "adapter_slots": 0, **fields})
    assert profile_fingerprint(p) == before
    # And slots change it: the flags they add are part of what runs.
    if registry().get(p.engine).loads_adapters_at_runtime and p.engine != "sglang":
        with_slots = p.model_copy(update={"adapter_slots": 4})
        assert profile_fingerprint(with_slots) != before


@pytest.mark.parametrize("engine", ["vllm", "sglang", "sim"])
def test_slots_0_add_no_flag_or_variable(engine: str) -> None:
    fields: dict[str, Any] = {"engine": engine}
    if engine == "sim":
        fields.update(gpu_class="cpu", model_path="sim://m")
    [c] = build(spec(profile(adapter_slots=0, **fields)))
    text = " ".join(c.args)
    assert "lora" not in text.lower() and "--api-server-count" not in text
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in c.env
