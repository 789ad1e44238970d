"""Golden commands for vLLM, one per topology: every argv element and variable spelled out."""

from __future__ import annotations

import json

from llmgw.engines import Adapter, KVHashParams
from llmgw.engines.vllm import cpu_list
from tests.engines.engines_testkit import SEED, build, profile, registry, spec

INHERITED = {"HOME": "/root", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64", "PATH": "/usr/bin:/bin"}


def test_one_gpu_with_api_key_binds_loopback_and_keeps_key_off_argv() -> None:
    s = spec(profile(), api_key="sk-shard-key-123456")
    [c] = build(s)
    assert c.name == "vllm"
    assert c.path == "vllm"
    assert list(c.args) == [
        "serve", "/models/llama-3-8b",
        "--served-model-name", "llama-3-8b",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1",
    ]  # fmt: skip
    assert c.env == {
        **INHERITED,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "0",
        "NCCL_IB_DISABLE": "1",
        "VLLM_API_KEY": "sk-shard-key-123456",
        # Stored responses kept for follow-ups (previous_response_id, GET, cancel).
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
    }
    assert list(c.env) == sorted(c.env)
    assert not c.wait_for_leader_port


def test_tp8_with_kv_events_publishes_to_the_agent_with_a_fixed_seed() -> None:
    p = profile(tp=8, kv_events=True, kv_hash=KVHashParams(seed=SEED, block_size=32))
    s = spec(p, kv_events_port=41001, kv_replay_port=41002, bind_addr="10.0.0.5")
    [c] = build(s)
    assert list(c.args) == [
        "serve", "/models/llama-3-8b",
        "--served-model-name", "llama-3-8b",
        "--host", "10.0.0.5",
        "--port", "8100",
        "--tensor-parallel-size", "8",
        "--pipeline-parallel-size", "1",
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor",
        "--block-size", "32",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:41001","publisher":"zmq",'
        '"replay_endpoint":"tcp://127.0.0.1:41002","topic":"kv@shard-1"}',
    ]  # fmt: skip
    assert c.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert c.env["PYTHONHASHSEED"] == SEED
    kv = json.loads(c.args[-1])
    assert kv["endpoint"] == "tcp://127.0.0.1:41001"  # connects: no "*" in it


def test_kv_events_off_sets_no_hash_flags_and_no_seed() -> None:
    [c] = build(spec(profile(kv_hash=KVHashParams(seed=SEED))))
    assert "--kv-events-config" not in c.args
    assert "--prefix-caching-hash-algo" not in c.args
    assert "--block-size" not in c.args
    assert "PYTHONHASHSEED" not in c.env


def test_lora_adapters_in_order_under_one_flag() -> None:
    p = profile(adapters=[Adapter(name="sql", path="/a/sql"), Adapter(name="chat", path="/a/chat")])
    [c] = build(spec(p))
    assert list(c.args[-4:]) == ["--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat"]


def _two_node_ib(rank: int, backend: str) -> list:  # type: ignore[type-arg]
    p = profile(
        tp=16, nodes=2, gpus_per_node=8, multinode_backend=backend, args=["--max-model-len", "8192"]
    )
    s = spec(
        p,
        rank=rank,
        nnodes=2,
        leader_addr="10.1.0.1",
        leader_port=29500,
        node_addr=f"10.1.0.{rank + 1}",
        hcas=["mlx5_0", "mlx5_1"],
        mgmt_interface="eth0",
        fabric="ib:spine-a",
        gpu_indices=[0, 1, 2, 3, 4, 5, 6, 7],
    )
    return build(s)


IB_ENV = {
    **INHERITED,
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    "GLOO_SOCKET_IFNAME": "eth0",
    "NCCL_IB_DISABLE": "0",
    "NCCL_IB_HCA": "mlx5_0,mlx5_1",
    "NCCL_SOCKET_IFNAME": "eth0",
    "VLLM_ENABLE_RESPONSES_API_STORE": "1",
}
COMMON_TP16 = [
    "serve", "/models/llama-3-8b",
    "--served-model-name", "llama-3-8b",
    "--host", "127.0.0.1",
    "--port", "8100",
    "--tensor-parallel-size", "16",
    "--pipeline-parallel-size", "1",
]  # fmt: skip


def test_two_node_tp16_native_leader_and_headless_worker() -> None:
    [leader] = _two_node_ib(0, "native")
    [worker] = _two_node_ib(1, "native")
    native = ["--nnodes", "2", "--master-addr", "10.1.0.1", "--master-port", "29500"]
    assert list(leader.args) == [
        *COMMON_TP16,
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.1.0.1", "--master-port", "29500",
        "--max-model-len", "8192",
    ]  # fmt: skip
    assert list(worker.args) == [
        *COMMON_TP16,
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.0.1", "--master-port", "29500",
        "--headless",
        "--max-model-len", "8192",
    ]  # fmt: skip
    assert all(f in leader.args for f in native)
    assert leader.name == "vllm" and worker.name == "vllm-headless"
    assert leader.env == {**IB_ENV, "VLLM_HOST_IP": "10.1.0.1"}
    assert worker.env == {**IB_ENV, "VLLM_HOST_IP": "10.1.0.2"}


def test_two_node_tp16_ray_head_then_server_and_worker_join() -> None:
    head, server = _two_node_ib(0, "ray")
    [join] = _two_node_ib(1, "ray")
    assert (head.name, head.path) == ("ray-head", "ray")
    assert list(head.args) == [
        "start", "--head", "--port=29500",
        "--node-ip-address", "10.1.0.1", "--disable-usage-stats", "--block",
    ]  # fmt: skip
    assert not head.wait_for_leader_port
    assert server.wait_for_leader_port
    assert list(server.args) == [
        *COMMON_TP16,
        "--distributed-executor-backend", "ray",
        "--max-model-len", "8192",
    ]  # fmt: skip
    assert (join.name, join.path) == ("ray-worker", "ray")
    assert list(join.args) == [
        "start", "--address=10.1.0.1:29500",
        "--node-ip-address", "10.1.0.2", "--disable-usage-stats", "--block",
    ]  # fmt: skip
    assert join.wait_for_leader_port
    # Ray's workers inherit the raylet's environment: NCCL rules on `ray start` too.
    assert head.env == server.env == {**IB_ENV, "VLLM_HOST_IP": "10.1.0.1"}
    assert join.env == {**IB_ENV, "VLLM_HOST_IP": "10.1.0.2"}


def test_roce_sets_the_gid_index() -> None:
    p = profile(tp=16, nodes=2, gpus_per_node=8, multinode_backend="native")
    s = spec(
        p, rank=0, nnodes=2, leader_addr="10.2.0.1", leader_port=29500,
        hcas=["mlx5_2"], gid_index=3, mgmt_interface="ens1", fabric="roce:leaf-3",
    )  # fmt: skip
    [c] = build(s)
    assert c.env["NCCL_IB_HCA"] == "mlx5_2"
    assert c.env["NCCL_IB_GID_INDEX"] == "3"
    assert c.env["NCCL_IB_DISABLE"] == "0"
    assert "NCCL_MNNVL_ENABLE" not in c.env


def test_nvl_domain_enables_mnnvl_and_cumem_only_across_nodes() -> None:
    p = profile(tp=8, nodes=2, gpus_per_node=4, multinode_backend="native")
    s = spec(
        p, rank=0, nnodes=2, leader_addr="10.3.0.1", leader_port=29500,
        fabric="nvl:rack-7", mgmt_interface="eth0", gpu_indices=[0, 1, 2, 3],
    )  # fmt: skip
    [c] = build(s)
    assert c.env["NCCL_MNNVL_ENABLE"] == "1"
    assert c.env["NCCL_CUMEM_ENABLE"] == "1"
    assert c.env["NCCL_IB_DISABLE"] == "1"
    [single] = build(spec(profile(tp=4), fabric="nvl:rack-7"))
    assert "NCCL_MNNVL_ENABLE" not in single.env


def test_mig_instance_is_addressed_by_uuid() -> None:
    s = spec(profile(), gpu_indices=[1000], gpu_uuids=["MIG-5c3f6a7e-0000-4c1f-9a1e-1234567890ab"])
    [c] = build(s)
    assert c.env["CUDA_VISIBLE_DEVICES"] == "MIG-5c3f6a7e-0000-4c1f-9a1e-1234567890ab"


def test_sleep_mode_makes_a_replica_suspendable_with_vllms_own_calls() -> None:
    eng = registry().get("vllm")
    plain = profile()
    assert not eng.can_suspend(plain)  # no sleep mode: an idle replica is stopped
    assert "VLLM_SERVER_DEV_MODE" not in build(spec(plain))[0].env

    sleepy = profile(args=["--enable-sleep-mode"])
    assert eng.can_suspend(sleepy)
    [c] = build(spec(sleepy))
    assert c.args[-1] == "--enable-sleep-mode"
    # vLLM serves /sleep and /wake_up only in its development mode.
    assert c.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert eng.suspend_calls == ("/sleep?level=1&mode=wait",)
    assert eng.resume_calls == ("/wake_up",)
    # The last spelling wins, as argparse's BooleanOptionalAction keeps it; an
    # abbreviation and the underscore spelling are the flag too.
    assert not eng.can_suspend(profile(args=["--enable-sleep-mode", "--no-enable-sleep-mode"]))
    assert eng.can_suspend(profile(args=["--no-enable-sleep-mode", "--enable_sleep_mode"]))
    assert eng.can_suspend(profile(args=["--enable-sleep"]))
    # Other engines without a suspend never are.
    assert not registry().get("sglang").can_suspend(profile(engine="sglang"))


# --- vLLM on the CPU (issue 35) -----------------------------------------------------------------


def test_cpu_shard_is_bound_to_its_cores_with_a_kv_cache_and_no_gpu() -> None:
    p = profile(
        gpu_class="cpu", threads=4, kv_events=True, kv_hash=KVHashParams(seed=SEED, block_size=32)
    )
    s = spec(p, threads=4, cpu_cores=[6, 2, 3, 4], kv_events_port=41001, kv_replay_port=41002)
    [c] = build(s, {**INHERITED, "VLLM_CPU_OMP_THREADS_BIND": "0-63"})
    assert list(c.args) == [
        "serve", "/models/llama-3-8b",
        "--served-model-name", "llama-3-8b",
        "--host", "127.0.0.1",
        "--port", "8100",
        "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1",
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor",
        "--block-size", "32",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:41001","publisher":"zmq",'
        '"replay_endpoint":"tcp://127.0.0.1:41002","topic":"kv@shard-1"}',
    ]  # fmt: skip
    assert c.env == {
        **INHERITED,
        # Every GPU hidden: a CUDA-capable build must not reach for another shard's card.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "",
        "NCCL_IB_DISABLE": "1",
        "OMP_NUM_THREADS": "4",
        "PYTHONHASHSEED": SEED,
        # The agent's cores, as vLLM's parser reads a list; the agent's own value is dropped.
        "VLLM_CPU_OMP_THREADS_BIND": "2-4,6",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
    }


def test_cpu_kv_cache_from_the_profile_env_and_no_binding_without_chosen_cores() -> None:
    p = profile(gpu_class="cpu", threads=2, env={"VLLM_CPU_KVCACHE_SPACE": "4"})
    [c] = build(spec(p))
    assert c.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert c.env["OMP_NUM_THREADS"] == "2"  # the profile's count when placement gave none
    # A spec no agent filled (llmgw engines command): vLLM's "auto" would take a whole NUMA
    # node's cores, the other shards' included.
    assert c.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "--block-size" not in c.args  # vLLM's CPU default (128) is a multiple of 32
    # On a GPU none of it is set.
    [g] = build(spec(profile()))
    assert not {"OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"} & set(
        g.env
    )


def test_cpu_list_writes_runs_as_ranges() -> None:
    assert cpu_list([]) == ""
    assert cpu_list([3]) == "3"
    assert cpu_list([5, 0, 1, 2, 7, 8, 10]) == "0-2,5,7-8,10"


def test_a_cpu_replica_cannot_suspend_and_says_why() -> None:
    eng = registry().get("vllm")
    cpu = profile(gpu_class="cpu", threads=2)
    assert not eng.can_suspend(cpu)
    assert eng.suspend_refusal(cpu) == (
        "vLLM's sleep mode is CUDA-only, and the profile runs on the CPU"
    )
    assert "VLLM_SERVER_DEV_MODE" not in build(spec(cpu))[0].env
    assert eng.suspend_refusal(profile()) == (
        "the profile's args do not turn on vLLM's sleep mode (--enable-sleep-mode)"
    )
    assert eng.suspend_refusal(profile(args=["--enable-sleep-mode"])) == ""
    llama = profile(engine="llamacpp", gpu_class="cpu")
    assert registry().get("llamacpp").suspend_refusal(llama) == "llamacpp has no suspend"
