"""Issue 8's engines items: DP counted in GPUs, placement requirements, TRT-LLM rank
uniformity, the served name, admin-API profiles pasted into specs, the inherited
environment, and one rule for the KV hash seed."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

import pytest

from llmgw.engines import (
    PlacementRequirements,
    Profile,
    base_env_from,
    check_replica_specs,
    hash_seed_problem,
    is_secret_name,
    parse_shard_spec,
    placement_requirements,
)
from llmgw.errors import SpecError
from tests.engines.engines_testkit import SEED, build, profile, registry, spec

# --- item 11: data parallelism is counted in GPUs ---------------------------


def test_vllm_data_parallelism_needs_its_gpus() -> None:
    p = profile(args=["--data-parallel-size", "4"])
    eng = registry().get("vllm")
    assert eng.gpus_per_shard(p) == 4
    assert placement_requirements(p).gpus_per_node == 4
    with pytest.raises(SpecError, match="needs 4 GPUs per node, the node has 1"):
        eng.validate(p, [_gpu(0)])
    # A spec with one GPU is refused, not launched to crash-loop.
    with pytest.raises(SpecError, match="gives 1 GPUs but the profile needs 4"):
        build(spec(p, gpu_indices=[0]))
    [cmd] = build(spec(p, gpu_indices=[0, 1, 2, 3]))
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    # Every spelling counts: a prefix, `=`, underscores, the short flag glued or not.
    for args in (["--data-parallel-si", "2"], ["--data_parallel_size=2"], ["-dp", "2"]):
        assert eng.gpus_per_shard(profile(args=args)) == 2, args


def test_data_parallelism_checks() -> None:
    eng = registry().get("vllm")
    with pytest.raises(SpecError, match="does not match TP 2 x PP 1 x DP 2 = 4"):
        eng.validate(profile(tp=2, gpus_per_node=2, args=["-dp", "2"]), [])
    eng.validate(profile(tp=2, gpus_per_node=4, args=["-dp", "2"]), [])
    with pytest.raises(SpecError, match="across 2 nodes is refused"):
        eng.validate(profile(nodes=2, gpus_per_node=2, args=["-dp", "2"]), [])
    with pytest.raises(SpecError, match="'x' is not an integer"):
        eng.validate(profile(args=["-dp", "x"]), [])
    # SGLang's DP attention splits the TP group instead of adding GPUs.
    sg = registry().get("sglang")
    assert sg.gpus_per_shard(profile(engine="sglang", tp=4, args=["--dp-size", "2"])) == 8
    dpa = profile(engine="sglang", tp=4, args=["--dp-size", "2", "--enable-dp-attention"])
    assert sg.gpus_per_shard(dpa) == 4


def test_placement_requirements_shape() -> None:
    req = placement_requirements(profile())
    assert req == PlacementRequirements(
        gpu_class="h100",
        nodes=1,
        gpus_per_node=1,
        threads=0,
        cpu_only=False,
        mig_allowed=True,
        same_gpu_indices_across_nodes=False,
        same_hcas_across_nodes=False,
    )
    with pytest.raises(FrozenInstanceError):
        req.nodes = 2  # type: ignore[misc]
    assert not hasattr(req, "__dict__")  # slotted
    assert not placement_requirements(profile(tp=2)).mig_allowed
    assert not placement_requirements(profile(args=["-dp", "2"])).mig_allowed
    cpu = placement_requirements(profile(engine="llamacpp", gpu_class="cpu", threads=8))
    assert (cpu.cpu_only, cpu.gpus_per_node, cpu.threads, cpu.mig_allowed) == (True, 0, 8, False)
    trt = placement_requirements(profile(engine="trtllm", tp=4, nodes=2, gpus_per_node=2))
    assert trt.same_gpu_indices_across_nodes and trt.same_hcas_across_nodes
    assert not placement_requirements(profile(engine="trtllm", tp=2)).same_hcas_across_nodes
    vl = placement_requirements(profile(tp=4, nodes=2, gpus_per_node=2))
    assert not vl.same_gpu_indices_across_nodes


# --- item 12: mpirun -x copies the leader's devices to every rank -----------------


def _trt_specs(**rank1: Any) -> list[Any]:
    p = profile(engine="trtllm", tp=4, nodes=2, gpus_per_node=2)
    common: dict[str, Any] = {
        "nnodes": 2,
        "leader_addr": "10.0.0.1",
        "leader_port": 29500,
        "peer_addrs": ["10.0.0.1", "10.0.0.2"],
        "hcas": ["mlx5_0"],
        "mgmt_interface": "eth0",
    }
    leader = spec(p, rank=0, shard_id="s0", gpu_indices=[0, 1], **common)
    worker = spec(p, rank=1, shard_id="s1", **{**common, "gpu_indices": [0, 1], **rank1})
    return [leader, worker]


def test_trtllm_ranks_must_match_the_leaders_devices() -> None:
    check_replica_specs(_trt_specs())
    with pytest.raises(SpecError, match="rank 1 has gpu_indices \\(2, 3\\) but the leader"):
        check_replica_specs(_trt_specs(gpu_indices=[2, 3]))
    with pytest.raises(SpecError, match="rank 1 has hcas"):
        check_replica_specs(_trt_specs(hcas=["mlx5_1"]))
    with pytest.raises(SpecError, match=r"ranks \[0\] are not 0\.\.1"):
        check_replica_specs(_trt_specs()[:1])
    # vLLM starts each rank with its own environment: no such rule.
    p = profile(tp=4, nodes=2, gpus_per_node=2)
    check_replica_specs(
        [
            spec(p, rank=0, nnodes=2, gpu_indices=[0, 1], hcas=["mlx5_0"]),
            spec(p, rank=1, nnodes=2, gpu_indices=[2, 3], hcas=["mlx5_1"], shard_id="s1"),
        ]
    )


# --- item 9: the engine answers to the model's name ----------------------------


def test_served_name_defaults_to_the_models_name() -> None:
    p = profile(served_model_name="", model="llama-3-8b-instruct")
    for engine, flag in (("vllm", "--served-model-name"), ("sglang", "--served-model-name"),
                         ("llamacpp", "--alias"), ("sim", "--served-model-name")):  # fmt: skip
        [cmd] = build(spec(p.model_copy(update={"engine": engine})))
        args = list(cmd.args)
        assert args[args.index(flag) + 1] == "llama-3-8b-instruct", engine
    explicit = profile(served_model_name="chat", model="llama-3-8b-instruct")
    [cmd] = build(spec(explicit))
    assert cmd.args[cmd.args.index("--served-model-name") + 1] == "chat"


# --- small thing: an admin API profile pastes into a spec ------------------------

ADMIN_PROFILE: dict[str, Any] = {
    # The shape GET /admin/v1/profiles/{name} returns (schemas.ProfileOut).
    "name": "llama-h100",
    "model": "llama-3-8b",
    "engine": "vllm",
    "gpu_class": "h100",
    "tp": 1,
    "pp": 1,
    "gpus_per_node": 0,
    "nodes": 1,
    "model_path": "/models/llama-3-8b",
    "served_model_name": "",
    "args": ["--max-model-len", "8192"],
    "env": {"NCCL_DEBUG": "WARN"},
    "secret_env_keys": ["HF_TOKEN"],
    "adapters": [],
    "kv_events": True,
    "threads": 0,
    "kv_hash_seed": SEED,
    "kv_block_size": 32,
    "kv_hash_algo": "sha256_cbor",
    "kv_extra_key_format": "legacy",
    "description": "8B chat",
    "fingerprint": "ab" * 32,
    "version": 3,
    "created_at": "2026-11-30T12:00:00Z",
    "updated_at": "2026-11-30T12:00:00Z",
}


def test_an_admin_api_profile_is_accepted_as_a_spec_profile() -> None:
    s = parse_shard_spec(
        {
            "replica_id": "r",
            "shard_id": "s",
            "http_port": 8000,
            "gpu_indices": [0],
            "kv_events_port": 5557,
            "profile": ADMIN_PROFILE,
        }
    )
    p = s.profile
    assert (p.kv_hash.seed, p.kv_hash.block_size, p.kv_hash.extra_key_format) == (
        SEED,
        32,
        "legacy",
    )
    assert p.served_name == "llama-3-8b"
    assert set(p.secret_env) == {"HF_TOKEN"}
    [cmd] = build(s)
    assert cmd.args[cmd.args.index("--served-model-name") + 1] == "llama-3-8b"
    assert cmd.env["PYTHONHASHSEED"] == SEED
    # Both shapes at once is ambiguous; a typo still fails.
    with pytest.raises(ValueError, match="give the KV hash parameters once"):
        Profile.model_validate({**ADMIN_PROFILE, "kv_hash": {"seed": SEED}})
    with pytest.raises(ValueError, match="kv_hash_sed"):
        Profile.model_validate({**ADMIN_PROFILE, "kv_hash_sed": SEED})


# --- item 7: the inherited environment is an allow-list ------------------------------


def test_base_env_keeps_what_engines_need_and_no_credentials() -> None:
    shell = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HF_HOME": "/hf",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "NCCL_DEBUG": "INFO",
        "AWS_SECRET_ACCESS_KEY": "aws-secret",
        "AWS_REGION": "eu-west-1",
        "GITHUB_TOKEN": "ghp_x",
        "HF_TOKEN": "hf_x",
        "DATABASE_URL": "postgresql://u:pw@h/db",
        "HTTPS_PROXY": "http://u:pw@proxy:3128",
        "LLMGW_ADMIN_TOKEN": "t",
        "RANDOM_THING": "x",
        "NCCL_IB_PASSWORD": "odd",
    }
    assert base_env_from(shell) == {
        "HF_HOME": "/hf",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "NCCL_DEBUG": "INFO",
        "PATH": "/usr/bin",
    }
    for name in ("AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "HF_TOKEN", "PGPASSWORD",
                 "WANDB_API_KEY", "DATABASE_URL", "--hf-token", "SOME_PRIVATE_KEY"):  # fmt: skip
        assert is_secret_name(name), name
    for name in ("PATH", "HF_HOME", "NCCL_DEBUG", "CUDA_VISIBLE_DEVICES", "--max-model-len"):
        assert not is_secret_name(name), name


# --- item 7: one rule for the KV hash seed --------------------------------------------


@pytest.mark.parametrize(
    ("seed", "ok"),
    [("1", True), ("4294967295", True), (SEED, True), ("0", False), ("042", False),
     ("abc", False), ("-1", False), ("4294967296", False), ("", False), ("١٢", False)],
)  # fmt: skip
def test_one_seed_rule(seed: str, ok: bool) -> None:
    problem = hash_seed_problem(seed)
    assert (problem is None) == ok
    if not ok:
        assert "1 to 4294967295" in str(problem)


def _gpu(i: int) -> Any:
    from llmgw.engines import GPUInfo

    return GPUInfo(index=i, name="NVIDIA H100 80GB HBM3", compute_capability="9.0")


def test_the_control_planes_bridge_passes_the_models_name() -> None:
    from llmgw.controlplane.profile_checks import LAUNCH_FIELDS, check_profile, engine_profile

    fields: dict[str, Any] = {
        "engine": "vllm", "gpu_class": "h100", "tp": 1, "pp": 1, "gpus_per_node": 0,
        "nodes": 1, "model_path": "/models/llama", "served_model_name": "", "args": [],
        "env": {}, "secret_env": {}, "adapters": [], "kv_events": False, "threads": 0,
        "kv_hash_seed": SEED, "kv_block_size": 16, "kv_hash_algo": "sha256_cbor",
        "kv_extra_key_format": "tagged", "multinode_backend": "ray", "adapter_slots": 0,
    }  # fmt: skip
    assert set(fields) == set(LAUNCH_FIELDS)
    assert engine_profile("p", fields, model="llama").served_name == "llama"
    named = check_profile("p", {**fields, "served_model_name": "llama"})
    assert check_profile("p", fields, model="llama") == named
