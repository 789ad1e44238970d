"""Golden commands for SGLang, llama.cpp, TensorRT-LLM, Megatron and the simulator."""

from __future__ import annotations

import pytest

from llmgw.engines import Adapter, KVHashParams, profile_fingerprint
from llmgw.nodeagent.tokenizer_ship import tokenizer_dir
from llmgw.simengine.hf_tokens import tiny_model_dir
from tests.engines.engines_testkit import SEED, build, profile, registry, spec

INHERITED = {"HOME": "/root", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64", "PATH": "/usr/bin:/bin"}
GPU0 = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0", "NCCL_IB_DISABLE": "1"}


# --- SGLang ---------------------------------------------------------------------


def _sglang(rank: int, **kw: object) -> list:  # type: ignore[type-arg]
    p = profile(engine="sglang", tp=16, nodes=2, gpus_per_node=8)
    s = spec(
        p, rank=rank, nnodes=2, leader_addr="10.1.0.1", leader_port=29600,
        hcas=["mlx5_0"], mgmt_interface="eth0", runtime_dir="/var/lib/llmgw/shards/s1", **kw,
    )  # fmt: skip
    return build(s)


def test_sglang_two_node_api_key_goes_to_a_private_config_file() -> None:
    [c] = _sglang(0, api_key="sk-sglang-key-0001")
    assert (c.name, c.path) == ("sglang", "python3")
    assert list(c.args) == [
        "-m", "sglang.launch_server",
        "--model-path", "/models/llama-3-8b",
        "--served-model-name", "llama-3-8b",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--tp-size", "16",
        "--pp-size", "1",
        "--device", "cuda",
        "--enable-metrics",
        "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.1.0.1:29600",
        "--config", "/var/lib/llmgw/shards/s1/sglang-config.yaml",
    ]  # fmt: skip
    [f] = c.files
    assert f.path == "/var/lib/llmgw/shards/s1/sglang-config.yaml"
    assert f.mode == 0o600
    assert f.secret
    assert f.content == 'api-key: "sk-sglang-key-0001"\n'
    assert not any("sk-sglang-key-0001" in a for a in c.args)
    assert "sk-sglang-key-0001" not in c.env.values()


def test_sglang_workers_do_not_serve_http() -> None:
    [c] = _sglang(1)
    assert c.args[c.args.index("--node-rank") + 1] == "1"
    assert c.files == ()
    eng = registry().get("sglang")
    assert eng.serves_http(spec(profile(engine="sglang"), rank=0))
    p2 = profile(engine="sglang", tp=2, nodes=2, gpus_per_node=1)
    assert not eng.serves_http(spec(p2, rank=1, nnodes=2, leader_addr="a", leader_port=1))


def test_sglang_lora_and_help_through_the_interpreter() -> None:
    p = profile(
        engine="sglang", adapters=[Adapter(name="a", path="/l/a"), Adapter(name="b", path="/l/b")]
    )
    [c] = build(spec(p))
    assert list(c.args[-4:]) == ["--enable-lora", "--lora-paths", "a=/l/a", "b=/l/b"]
    assert registry().get("sglang").help_command(c) == (
        "python3",
        ("-m", "sglang.launch_server", "--help"),
    )


# --- llama.cpp -------------------------------------------------------------------


def test_llamacpp_cpu_only_shard_hides_gpus_and_sets_threads() -> None:
    p = profile(
        engine="llamacpp", gpu_class="cpu", model_path="/models/q4.gguf", served_model_name="tiny"
    )
    s = spec(p, threads=12, api_key="sk-llama-key-42")
    [c] = build(s)
    assert (c.name, c.path) == ("llama-server", "llama-server")
    assert list(c.args) == [
        "--model", "/models/q4.gguf",
        "--alias", "tiny",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--metrics",
        "-ngl", "0",
        "--threads", "12",
    ]  # fmt: skip
    assert c.env == {
        **INHERITED,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "",
        "LLAMA_API_KEY": "sk-llama-key-42",
        "NCCL_IB_DISABLE": "1",
    }


def test_llamacpp_gpu_lora_by_index_and_cpu_fallback_capability() -> None:
    p = profile(
        engine="llamacpp",
        model_path="/models/q4.gguf",
        adapters=[
            Adapter(name="first", path="/l/0.gguf"),
            Adapter(name="second", path="/l/1.gguf"),
        ],
    )
    [c] = build(spec(p))
    assert list(c.args) == [
        "--model", "/models/q4.gguf",
        "--alias", "llama-3-8b",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--metrics",
        "-ngl", "999",
        "--lora", "/l/0.gguf",
        "--lora", "/l/1.gguf",
    ]  # fmt: skip
    assert c.env == {**INHERITED, **GPU0}
    eng = registry().get("llamacpp")
    assert eng.falls_back_to_cpu
    assert eng.list_devices_command(c) == ("llama-server", ("--list-devices",))


def test_llamacpp_reads_a_cpu_fallback_from_its_log_and_its_device_list() -> None:
    eng = registry().get("llamacpp")
    log = "main: warning: not compiled with GPU offload support, --gpu-layers option ignored\n"
    assert eng.cpu_fallback_in_log(log) == "not compiled with GPU offload support"
    assert eng.cpu_fallback_in_log("main: server is listening\n") == ""
    device = "CUDA0: NVIDIA H100 80GB HBM3 (81559 MiB, 80000 MiB free)"
    assert eng.listed_devices(f"Available devices:\n  {device}\n") == [device]
    assert eng.listed_devices("Available devices:\n") == []
    # An engine that never falls back finds nothing in any log.
    assert registry().get("vllm").cpu_fallback_in_log(log) == ""


def test_llamacpp_profile_gpu_layers_replace_the_default() -> None:
    [c] = build(spec(profile(engine="llamacpp", args=["-ngl", "20"])))
    assert c.args.count("-ngl") == 1
    assert list(c.args[-2:]) == ["-ngl", "20"]


# --- TensorRT-LLM ----------------------------------------------------------------


def test_trtllm_single_node_tp8() -> None:
    [c] = build(spec(profile(engine="trtllm", tp=8)))
    assert (c.name, c.path) == ("trtllm-serve", "/opt/trtllm/bin/trtllm-serve")
    assert list(c.args) == [
        "/models/llama-3-8b",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--tp_size", "8",
        "--pp_size", "1",
        "--gpus_per_node", "8",
    ]  # fmt: skip
    assert not registry().get("trtllm").authenticates


def test_trtllm_two_nodes_run_one_mpi_world_from_the_leader() -> None:
    p = profile(engine="trtllm", tp=8, pp=2, nodes=2, gpus_per_node=8)
    common = {
        "nnodes": 2, "leader_addr": "10.1.0.1", "leader_port": 29700,
        "peer_addrs": ["10.1.0.1", "10.1.0.2"], "hcas": ["mlx5_0"], "mgmt_interface": "eth0",
    }  # fmt: skip
    [c] = build(spec(p, rank=0, **common))
    assert (c.name, c.path) == ("mpirun", "mpirun")
    assert list(c.args) == [
        "-np", "16",
        "--host", "10.1.0.1:8,10.1.0.2:8",
        "-x", "CUDA_DEVICE_ORDER", "-x", "CUDA_VISIBLE_DEVICES", "-x", "GLOO_SOCKET_IFNAME",
        "-x", "NCCL_IB_DISABLE", "-x", "NCCL_IB_HCA", "-x", "NCCL_SOCKET_IFNAME",
        "trtllm-llmapi-launch", "/opt/trtllm/bin/trtllm-serve",
        "/models/llama-3-8b",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--tp_size", "8",
        "--pp_size", "2",
        "--gpus_per_node", "8",
    ]  # fmt: skip
    assert build(spec(p, rank=1, **common)) == []
    assert not registry().get("trtllm").serves_http(spec(p, rank=1, **common))


def test_trtllm_lora_goes_into_an_options_file() -> None:
    p = profile(engine="trtllm", adapters=[Adapter(name="a", path="/l/a")])
    [c] = build(spec(p))
    [f] = c.files
    assert f.content == 'lora_config:\n  lora_dir:\n    - "/l/a"\n'
    assert not f.secret
    assert list(c.args[-2:]) == ["--extra_llm_api_options", "trtllm-options.yaml"]


# --- Megatron --------------------------------------------------------------------


def test_megatron_single_node_uses_a_standalone_rendezvous() -> None:
    p = profile(engine="megatron", tp=2, model_path="/ckpt/gpt", args=["--bf16"])
    [c] = build(spec(p))
    assert (c.name, c.path) == ("torchrun", "torchrun")
    assert list(c.args) == [
        "--nproc-per-node", "2",
        "--standalone",
        "-m", "examples.inference.launch_inference_server",
        "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "1",
        "--load", "/ckpt/gpt",
        "--use-checkpoint-args",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--bf16",
    ]  # fmt: skip
    assert c.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert c.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    eng = registry().get("megatron")
    assert eng.metrics_path is None
    assert eng.suspend_calls == ("/pause", "/suspend")
    assert eng.resume_calls == ("/resume", "/unpause")
    assert eng.help_command(c) == (
        "python3",
        ("-m", "examples.inference.launch_inference_server", "--help"),
    )


def test_megatron_two_nodes_through_torchrun() -> None:
    p = profile(engine="megatron", tp=8, pp=2, nodes=2, gpus_per_node=8)
    s = spec(p, rank=1, nnodes=2, leader_addr="10.1.0.1", leader_port=29800)
    [c] = build(s)
    assert list(c.args[:10]) == [
        "--nproc-per-node", "8",
        "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.1.0.1", "--master-port", "29800",
    ]  # fmt: skip


# --- simulator ---------------------------------------------------------------------


def test_sim_command_is_the_simcli_contract() -> None:
    p = profile(
        engine="sim",
        gpu_class="cpu",
        model_path="sim-model",
        served_model_name="demo",
        kv_events=True,
        kv_hash=KVHashParams(seed=SEED, block_size=16, extra_key_format="legacy"),
        adapters=[Adapter(name="sql", path="/l/sql"), Adapter(name="chat", path="/l/chat")],
        args=["--time-scale", "0.1"],
    )
    s = spec(p, api_key="sk-sim-key-0000", kv_events_port=45000, kv_replay_port=45001)
    [c] = build(s)
    assert (c.name, c.path) == ("simengine", "/opt/llmgw/bin/python")
    assert list(c.args) == [
        "-m", "llmgw", "simengine",
        "--model", "sim-model",
        "--served-model-name", "demo",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--block-size", "16",
        "--kv-extra-key-format", "legacy",
        "--lora-modules", "sql=/l/sql",
        "--lora-modules", "chat=/l/chat",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:45000","publisher":"zmq",'
        '"replay_endpoint":"tcp://127.0.0.1:45001","topic":"kv@shard-1"}',
        "--tokenizer", "tiny",
        "--time-scale", "0.1",
    ]  # fmt: skip
    assert c.env == {
        **INHERITED,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "",
        "NCCL_IB_DISABLE": "1",
        "PYTHONHASHSEED": SEED,
        "SIMENGINE_API_KEY": "sk-sim-key-0000",
    }


@pytest.mark.parametrize(
    ("args", "shipped"),
    [
        ([], "tiny"),
        (["--tokenizer", "builtin"], None),
        (["--tokenizer=builtin"], None),
        (["--tokenizer", "tiny"], "tiny"),
        (["--tokenizer", "/nowhere/model"], None),
    ],
)
def test_sim_tokenizes_with_the_tiny_model_unless_the_profile_names_a_tokenizer(
    args: list[str], shipped: str | None
) -> None:
    p = profile(engine="sim", gpu_class="cpu", model_path="sim://demo", args=args)
    [c] = build(spec(p))
    named = [a for a in c.args if a == "--tokenizer" or a.startswith("--tokenizer=")]
    assert named == (["--tokenizer"] if args == [] else [a for a in args if a.startswith("--tok")])
    if args == []:
        assert list(c.args[-2:]) == ["--tokenizer", "tiny"]
    # The agent ships the files the engine reads: the tiny model's for the default and `tiny`,
    # none for the constructed vocabulary or a directory not on this node.
    found = tokenizer_dir({"profile": p.model_dump(mode="json")})
    assert found == (tiny_model_dir() if shipped == "tiny" else None)


def test_sim_without_kv_events_sets_no_seed() -> None:
    [c] = build(spec(profile(engine="sim", gpu_class="cpu")))
    assert "PYTHONHASHSEED" not in c.env
    assert "--kv-events-config" not in c.args
    assert "SIMENGINE_API_KEY" not in c.env


def test_llama_cpp_is_stored_as_llamacpp_so_fingerprints_never_see_the_alias() -> None:
    written = profile(engine="llama.cpp", gpu_class="cpu", model_path="/m/q4.gguf")
    assert written.engine == "llamacpp"
    assert profile_fingerprint(written) == profile_fingerprint(
        profile(engine="llamacpp", gpu_class="cpu", model_path="/m/q4.gguf")
    )
    [c] = build(spec(written, threads=2))
    assert c.name == "llama-server"
