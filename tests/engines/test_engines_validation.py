"""Bad input gives one clear SpecError naming the profile, the rule and the numbers."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.engines import (
    Adapter,
    EngineRegistry,
    EnginesConfig,
    GPUInfo,
    KVHashParams,
    Readiness,
    parse_gpus,
    parse_shard_spec,
)
from llmgw.errors import SpecError
from tests.engines.engines_testkit import SEED, build, profile, registry, spec

H100 = GPUInfo(
    index=0, name="NVIDIA H100 80GB HBM3", compute_capability="9.0", memory_total_mb=81559
)


def gpus(n: int, name: str = "NVIDIA H100 80GB HBM3", cc: str = "9.0") -> list[GPUInfo]:
    return [GPUInfo(index=i, name=name, compute_capability=cc) for i in range(n)]


def validate(gpu_list: list[GPUInfo] | None = None, **kw: Any) -> list[str]:
    p = profile(**kw)
    return registry().get(p.engine).validate(p, gpu_list or [])


def refused(match: str, gpu_list: list[GPUInfo] | None = None, **kw: Any) -> SpecError:
    with pytest.raises(SpecError, match=match) as e:
        validate(gpu_list, **kw)
    assert "'llama-h100'" in e.value.message  # names the profile
    return e.value


def test_unknown_engine_names_the_engines_there_are() -> None:
    with pytest.raises(SpecError) as e:
        registry().get("vllmm")
    assert e.value.message == (
        "unknown engine 'vllmm' (have llamacpp, megatron, sglang, sim, trtllm, vllm)"
    )


def test_disabled_and_unoffered_engines() -> None:
    reg = EngineRegistry(EnginesConfig(disabled=("vllm",)))
    with pytest.raises(SpecError, match="disabled on this node"):
        reg.get("vllm")
    with pytest.raises(SpecError, match="serve_path"):
        reg.get("trtllm")
    assert reg.names() == ["llamacpp", "megatron", "sglang", "sim"]
    with pytest.raises(SpecError, match="unknown engines nope"):
        EngineRegistry(EnginesConfig(disabled=("nope",)))


def test_use_installed_points_the_engine_at_the_build() -> None:
    reg = registry()
    assert reg.use_installed("llamacpp", "/opt/llama/b4000/llama-server")
    [c] = reg.get("llamacpp").commands(spec(profile(engine="llamacpp")), base_env={})
    assert c.path == "/opt/llama/b4000/llama-server"
    assert not reg.use_installed("sglang", "/x")


def test_inconsistent_parallelism() -> None:
    err = refused(
        "2 nodes x 4 GPUs = 8 does not match TP 16 x PP 1 = 16", tp=16, nodes=2, gpus_per_node=4
    )
    assert err.field == "profile.gpus_per_node"
    refused("gpus_per_node is required for a 2-node profile", tp=16, nodes=2)
    refused("tp is 0", tp=0)
    refused("model_path is empty", model_path="")


def test_not_enough_and_mixed_gpus() -> None:
    refused("needs 8 GPUs per node, the node has 4", gpus(4), tp=8)
    mixed = [H100, GPUInfo(index=1, name="NVIDIA A100-SXM4-80GB", compute_capability="8.0")]
    refused("GPUs are not uniform .*H100.*A100.*may not mix", mixed, tp=2)


def test_mig_only_for_tp_pp_1() -> None:
    mig = [
        GPUInfo(index=1000 + i, name="NVIDIA A100 MIG 3g.40gb", compute_capability="8.0")
        for i in range(2)
    ]
    refused("MIG instances run TP = PP = 1 only, the profile has TP 2 x PP 1", mig, tp=2)
    warnings = validate(mig[:1])
    assert any("vllm#41848" in w for w in warnings)
    # And at launch, from the spec alone.
    s = spec(profile(tp=2), gpu_uuids=["MIG-a", "MIG-b"], gpu_indices=[1000, 1001])
    with pytest.raises(SpecError, match="MIG shards are TP = PP = 1"):
        build(s)


def test_engines_that_cannot_span_nodes_refuse_to() -> None:
    refused(
        "engine llamacpp runs on one node only, nodes is 2",
        engine="llamacpp",
        tp=2,
        nodes=2,
        gpus_per_node=1,
    )
    refused("engine sim runs on one node only", engine="sim", tp=2, nodes=2, gpus_per_node=1)


def test_cpu_profiles_only_on_cpu_engines() -> None:
    refused(
        "engine sglang does not run on CPU alone; use llamacpp or vllm", engine="sglang",
        gpu_class="cpu",
    )  # fmt: skip
    assert validate(gpu_class="cpu", threads=4) == []  # vLLM's CPU build (issue 35)
    refused("a CPU profile runs as one process", engine="llamacpp", gpu_class="cpu", tp=2)
    assert validate(engine="llamacpp", gpu_class="cpu", threads=8) == []


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("LD_PRELOAD", "injects the library"),
        ("LD_ANYTHING_NEW", "LD_\\* variables"),
        ("PYTHONPATH", "imports modules"),
        ("PYTHONWARNINGS", "imports the modules"),
        ("BASH_ENV", "bash runs"),
        ("BASH_FUNC_ls%%", "exported functions"),
        ("NCCL_NET_PLUGIN", "network plugin"),
        ("CUDA_VISIBLE_DEVICES", "pins each shard"),
        ("PYTHONHASHSEED", "kv_hash.seed"),
        ("VLLM_API_KEY", "own API key"),
        ("SGLANG_CONFIG", "config file"),
        ("LLMGW_SHARD_ID", "belong to llmgw"),
        ("VLLM_SERVER_DEV_MODE", "developer endpoints"),
    ],
)
def test_unsafe_env_is_refused_with_the_reason(name: str, why: str) -> None:
    err = refused(f"env may not set {name}: .*{why}", env={name: "x"})
    assert err.field == "profile.env"
    refused(f"secret_env may not set {name}", secret_env={name: "ref"})


def test_safe_env_is_accepted_and_overrides_generated_tuning() -> None:
    assert validate(env={"NCCL_DEBUG": "INFO", "HF_HOME": "/cache", "NCCL_IB_DISABLE": "1"}) == []
    p = profile(env={"NCCL_IB_DISABLE": "1", "LD_PRELOAD": "/evil.so"})
    [c] = build(spec(p, hcas=["mlx5_0"]))
    assert c.env["NCCL_IB_DISABLE"] == "1"  # the escape hatch
    assert "LD_PRELOAD" not in c.env  # skipped again at launch


@pytest.mark.parametrize("seed", [""])
def test_kv_events_needs_a_real_seed(seed: str) -> None:
    err = refused("kv_events needs kv_hash.seed", kv_events=True, kv_hash=KVHashParams(seed=seed))
    assert err.field == "profile.kv_hash.seed"


def test_kv_events_with_data_parallelism_or_on_engines_without_events() -> None:
    kv: dict[str, Any] = {"kv_events": True, "kv_hash": KVHashParams(seed=SEED)}
    refused("data parallelism 2 with kv_events is refused", args=["-dp", "2"], **kv)
    refused("data parallelism 4 with kv_events", args=["--data-parallel-size=4"], **kv)
    assert validate(args=["-dp", "2"]) == []  # without kv_events DP is the operator's call
    refused("engine sglang publishes no KV events", engine="sglang", **kv)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--port", "9000"], "--port"),
        (["--port=9000"], "--port"),
        (["-tp", "4"], "--tensor-parallel-size"),
        (["-tp=4"], "--tensor-parallel-size"),
        (["--tensor_parallel_size", "4"], "--tensor-parallel-size"),
        (["--po", "9000"], "--port"),  # argparse abbreviation
        (["--api-key", "k"], "--api-key"),
        (["--kv-events-config", "{}"], "--kv-events-config"),
        (["--served-model-name", "x"], "--served-model-name"),
        (["--distributed-executor-backend", "mp"], "--distributed-executor-backend"),
        (["--config", "x.yaml"], "--config"),
    ],
)
def test_reserved_vllm_flags_name_the_field_to_use(args: list[str], flag: str) -> None:
    err = refused(f"sets {flag}, which the vllm adapter sets itself", args=args)
    assert err.field == "profile.args"
    assert "instead" in err.message


def test_reserved_flags_depend_on_the_profile() -> None:
    assert validate(args=["--block-size", "64"]) == []  # tuning, without kv_events
    kv: dict[str, Any] = {"kv_events": True, "kv_hash": KVHashParams(seed=SEED)}
    refused("sets --block-size.*profile.kv_hash.block_size", args=["--block-size", "64"], **kv)
    assert validate(engine="llamacpp", args=["-t", "4"]) == []
    refused("sets --threads", engine="llamacpp", gpu_class="cpu", args=["-t", "4"])
    refused("sets --tp-size", engine="sglang", args=["--tp", "2"])
    refused("sets --host", engine="sim", args=["--host=0.0.0.0"])
    # A long flag that merely starts like a reserved one is not refused.
    assert validate(args=["--enable-lora-bias"]) == []


def test_compute_capability_table() -> None:
    v100 = gpus(1, "Tesla V100-SXM2-32GB", "7.0")
    refused(
        "quantization 'awq' \\(AWQ\\) needs compute capability 7.5 or newer, GPU 0 .*has 7.0",
        v100,
        args=["--quantization", "awq"],
    )
    refused("dtype bf16 .*needs compute capability 8.0", v100, args=["--dtype", "bfloat16"])
    assert validate(v100, args=["-q", "gptq"]) == []
    a100 = gpus(1, "NVIDIA A100", "8.0")
    warnings = validate(a100, args=["--quantization=fp8"])
    assert any("falls back" in w for w in warnings)
    refused("FP8 W8A8", gpus(1, "Tesla T4", "7.5"), args=["--quantization", "fp8"])
    refused("bf16", v100, engine="megatron", args=["--bf16"])
    assert validate(gpus(1, "odd", "unknown"), args=["--quantization", "awq"]) == []


def test_engines_without_auth_say_so() -> None:
    warnings = validate(engine="trtllm")
    assert any("checks no API key" in w for w in warnings)
    assert any("checks no API key" in w for w in validate(engine="megatron"))
    assert validate() == []


def test_spec_that_contradicts_its_profile() -> None:
    with pytest.raises(SpecError, match="gives 3 GPUs but the profile needs 2"):
        build(spec(profile(tp=2), gpu_indices=[0, 1, 2]))
    p = profile(tp=16, nodes=2, gpus_per_node=8)
    with pytest.raises(SpecError, match="needs leader_addr and leader_port"):
        build(spec(p, nnodes=2))
    with pytest.raises(SpecError, match="node_addr"):
        build(spec(p, rank=1, nnodes=2, leader_addr="10.0.0.1", leader_port=6379))
    kv = profile(kv_events=True, kv_hash=KVHashParams(seed=SEED))
    with pytest.raises(SpecError, match="kv_events_port is 0"):
        build(spec(kv))


def test_adapter_rules() -> None:
    dup = [Adapter(name="a", path="/1"), Adapter(name="a", path="/2")]
    refused("adapter name 'a' appears twice", adapters=dup)
    refused("may not contain '='", adapters=[Adapter(name="a=b", path="/1")])
    refused("contains ','", engine="llamacpp", adapters=[Adapter(name="a", path="/x,y")])
    refused("megatron serves no LoRA", engine="megatron", adapters=[Adapter(name="a", path="/1")])


def test_parse_errors_name_the_field() -> None:
    with pytest.raises(SpecError, match=r"profile\.tp: Input should be a valid integer"):
        parse_shard_spec(
            {
                "replica_id": "r",
                "shard_id": "s",
                "profile": {"name": "p", "engine": "vllm", "tp": "x"},
            }
        )
    with pytest.raises(SpecError, match="bogus: Extra inputs are not permitted"):
        parse_shard_spec(
            {
                "replica_id": "r",
                "shard_id": "s",
                "bogus": 1,
                "profile": {"name": "p", "engine": "vllm"},
            }
        )
    with pytest.raises(SpecError, match="must be a JSON list"):
        parse_gpus({"index": 0})


@pytest.mark.parametrize(
    ("readiness", "status", "was_ready", "state"),
    [
        (Readiness(frozenset()), None, False, "loading"),  # vLLM binds after loading
        (Readiness(frozenset()), 503, False, "unhealthy"),  # vLLM's 503 is a dead engine core
        (Readiness(frozenset({503})), 503, False, "loading"),  # SGLang, llama.cpp, sim
        (Readiness(frozenset({503})), 503, True, "unhealthy"),
        (Readiness(frozenset({503})), None, True, "unhealthy"),
        (Readiness(frozenset({503})), 200, False, "ready"),
    ],
)
def test_readiness_classification(
    readiness: Readiness, status: int | None, was_ready: bool, state: str
) -> None:
    assert readiness.classify(status, was_ready=was_ready) == state


def test_each_engine_declares_its_readiness() -> None:
    reg = registry()
    assert reg.get("vllm").readiness.classify(503, was_ready=False) == "unhealthy"
    for name in ("sglang", "llamacpp", "sim", "megatron"):
        assert reg.get(name).readiness.classify(503, was_ready=False) == "loading", name


def test_a_variable_name_cannot_smuggle_another_through_exec_syntax() -> None:
    refused(
        "env may not set PYTHONPATH=/evil: it is not a valid variable name",
        env={"PYTHONPATH=/evil": "x"},
    )
    refused("not a valid variable name", env={"": "x"})
    refused("env HF_HOME holds a NUL", env={"HF_HOME": "/a\0b"})
    refused("args\\[1\\] holds a NUL", args=["--x", "a\0"])
    [c] = build(spec(profile(env={"PYTHONPATH=/evil": "x", "OK": "a\0b"})))
    assert not any("=" in k for k in c.env)
    assert "OK" not in c.env


def test_gpu_uuids_name_the_same_devices_as_the_indices() -> None:
    with pytest.raises(SpecError, match="gpu_uuids names 1 devices but gpu_indices 2"):
        parse_shard_spec({
            "replica_id": "r", "shard_id": "s", "gpu_indices": [0, 1], "gpu_uuids": ["MIG-a"],
            "profile": {"name": "p", "engine": "vllm", "model_path": "/m"},
        })  # fmt: skip


@pytest.mark.parametrize("seed", ["0", "abc", "-1", "042", "4294967296", "1.5", " 7", "٣"])
def test_a_seed_python_would_refuse_is_refused(seed: str) -> None:
    # Python dies at start-up on such a PYTHONHASHSEED ("Fatal Python error:
    # config_init_hash_seed"): the engine would never run, so the profile never validates.
    with pytest.raises(ValueError, match="not a usable PYTHONHASHSEED"):
        KVHashParams(seed=seed)


def test_the_largest_seed_python_takes_is_accepted() -> None:
    assert KVHashParams(seed="4294967295").seed == "4294967295"


# --- vLLM on the CPU (issue 35): what CPU attention and the CPU build cannot run ---------------


def cpu(**kw: Any) -> dict[str, Any]:
    return {"gpu_class": "cpu", "threads": 4, **kw}


def test_cpu_vllm_refuses_kv_blocks_that_are_not_a_multiple_of_32() -> None:
    kv = {"kv_events": True}
    err = refused(
        r"kv_hash.block_size is 16, but vLLM's CPU attention takes KV blocks of a multiple of "
        r"32 tokens only .*; set it to 32, 64 or 128",
        **cpu(**kv, kv_hash=KVHashParams(seed=SEED)),  # the default block size, 16
    )
    assert err.field == "profile.kv_hash.block_size"
    assert validate(**cpu(**kv, kv_hash=KVHashParams(seed=SEED, block_size=64))) == []
    # Without kv_events the size is the profile's --block-size, in any spelling vLLM takes.
    err = refused(r"--block-size in args is 48", **cpu(args=["--block-size", "48"]))
    assert err.field == "profile.args"
    refused(r"--block-size in args is 16", **cpu(args=["--block_size=16"]))
    refused(r"--block-size in args is 'x', not a whole number", **cpu(args=["--block-size", "x"]))
    assert validate(**cpu(args=["--block-size=128"])) == []
    # A GPU profile keeps vLLM's own rules: 16 is its default there.
    assert validate(args=["--block-size", "16"]) == []


def test_cpu_vllm_refuses_sleep_mode_data_parallelism_and_a_fractional_cache() -> None:
    err = refused(
        r"--enable-sleep-mode is CUDA-only in vLLM, and this profile runs on the CPU; remove it",
        **cpu(args=["--enable-sleep-mode"]),
    )
    assert err.field == "profile.args"
    assert validate(**cpu(args=["--enable-sleep-mode", "--no-enable-sleep-mode"])) == []
    refused(
        r"data parallelism 2 on the CPU is refused.*run more replicas", **cpu(args=["-dp", "2"])
    )
    for bad in ("0.25", "0", "", "two"):
        err = refused(
            rf"env VLLM_CPU_KVCACHE_SPACE is {bad!r}, but vLLM reads a whole number of GiB",
            **cpu(env={"VLLM_CPU_KVCACHE_SPACE": bad}),
        )
        assert err.field == "profile.env"
    assert validate(**cpu(env={"VLLM_CPU_KVCACHE_SPACE": "8"})) == []
    # The size is the variable's: the flag vLLM would silently override is refused.
    refused(
        r"sets --kv-cache-memory-bytes, which the vllm adapter sets itself; remove it and use "
        r"the profile's env VLLM_CPU_KVCACHE_SPACE",
        **cpu(args=["--kv-cache-memory-bytes", "1000000000"]),
    )
    # The cores are the agent's to choose.
    refused(r"env may not set VLLM_CPU_OMP_THREADS_BIND: llmgw binds each CPU shard",
            **cpu(env={"VLLM_CPU_OMP_THREADS_BIND": "0-3"}))  # fmt: skip
    # On a GPU the CPU cache variable does nothing: a warning, not a refusal.
    [warning] = validate(env={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert "sizes vLLM's KV cache on the CPU only" in warning


def test_cpu_vllm_is_refused_at_launch_too() -> None:
    """A profile stored before these rules (or a spec from anywhere) must not start either."""
    bad = profile(**cpu(args=["--block-size", "16"]))
    with pytest.raises(SpecError, match="multiple of 32"):
        build(spec(bad))


def test_cpu_vllm_refuses_a_model_whose_heads_are_under_32_dimensions() -> None:
    eng = registry().get("vllm")
    p = profile(**cpu())
    assert eng.wants_model_config(p) and not eng.wants_model_config(profile())
    with pytest.raises(SpecError) as e:
        eng.check_model_config(p, {"head_dim": 16, "hidden_size": 256, "num_attention_heads": 4})
    assert e.value.message == (
        "profile 'llama-h100': the model's attention heads have 16 dimensions (its "
        "config.json), but vLLM's CPU attention needs 32 or more (it fails at the first "
        "request, then answers 500 until restarted); run this model on a GPU class or with "
        "llamacpp"
    )
    assert e.value.field == "profile.model_path"
    # No head_dim: hidden_size / num_attention_heads, as vLLM reads it; a multimodal model's
    # text_config where the top has neither.
    with pytest.raises(SpecError, match="have 16 dimensions"):
        eng.check_model_config(p, {"hidden_size": 128, "num_attention_heads": 8})
    with pytest.raises(SpecError, match="have 8 dimensions"):
        eng.check_model_config(p, {"text_config": {"hidden_size": 64, "num_attention_heads": 8}})
    eng.check_model_config(p, {"hidden_size": 128, "num_attention_heads": 2})  # 64: fine
    eng.check_model_config(p, {"architectures": ["Whatever"]})  # says nothing: left to vLLM
    eng.check_model_config(profile(), {"head_dim": 16})  # a GPU runs it
