"""From a desired shard to a launch: the digest, local policy, secret references, MIG UUIDs."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw.engines import EngineRegistry, EnginesConfig, SimConfig, base_env_from
from llmgw.errors import SpecError
from llmgw.nodeagent.policy import LocalPolicy, under_root
from llmgw.nodeagent.prepare import LaunchPorts, NodeFacts, build_launch, launch_digest, prepare
from llmgw.nodeagent.secrets import resolve_secret_refs
from llmgw.protocol import DesiredShard, GpuDevice
from tests.nodeagent.agent_harness import sim_shard

REGISTRY = EngineRegistry(EnginesConfig(sim=SimConfig(python_executable=sys.executable)))
GPUS = (
    GpuDevice(index=0, uuid="GPU-0", name="H100", gpu_class="H100", mig_enabled=True),
    GpuDevice(index=1000, uuid="MIG-abc", name="H100 MIG 1g", gpu_class="H100 MIG 1g",
              mig_parent_uuid="GPU-0"),
    GpuDevice(index=1, uuid="GPU-1", name="H100", gpu_class="H100"),
    GpuDevice(index=2, uuid="SIM-n-2", name="sim", gpu_class="sim", simulated=True),
)  # fmt: skip


def facts(policy: LocalPolicy | None = None, environ: dict[str, str] | None = None) -> NodeFacts:
    env = environ if environ is not None else dict(os.environ)
    return NodeFacts(
        gpus=GPUS,
        fabrics=(),
        mgmt_addr="10.0.0.5",
        bind_addr="127.0.0.1",
        policy=policy or LocalPolicy(),
        environ=env,
        base_env=base_env_from(env),
    )


def vllm_shard(sid: str = "v1", **profile: Any) -> DesiredShard:
    p: dict[str, Any] = {
        "name": "p",
        "engine": "vllm",
        "gpu_class": "H100",
        "model_path": "/models/m",
    }
    p.update(profile)
    return DesiredShard(
        shard_id=sid,
        replica_id="r",
        fingerprint="f",
        spec={"replica_id": "r", "shard_id": sid, "profile": p, "gpu_indices": [1]},
        engine_api_key="k" * 20,
    )


def test_digest_ignores_what_the_agent_fills_in_and_follows_what_it_does_not() -> None:
    base = sim_shard("s")
    same = base.model_copy(update={"spec": {**base.spec, "http_port": 1234, "bind_addr": "x"}})
    assert launch_digest(base) == launch_digest(same)
    for changed in (
        base.model_copy(update={"fingerprint": "fp-2"}),
        base.model_copy(update={"engine_api_key": "rotated-key-0123456789"}),
        base.model_copy(update={"spec": {**base.spec, "gpu_indices": [3]}}),
    ):
        assert launch_digest(changed) != launch_digest(base)


def test_a_good_spec_prepares_and_launches_with_the_key_in_env_only() -> None:
    p = prepare(sim_shard("s", kv_events=True), REGISTRY, facts())
    assert p.launchable, p.error
    assert p.needs_kv_ports and p.suspendable
    spec, (cmd,) = build_launch(p, facts(), LaunchPorts(20001, 20002, 20003), runtime_dir="/x")
    assert (spec.http_port, spec.kv_events_port, spec.kv_replay_port) == (20001, 20002, 20003)
    assert cmd.env["SIMENGINE_API_KEY"] == "engine-key-0123456789"
    assert "engine-key-0123456789" not in " ".join(cmd.args)
    assert not any(k.startswith("LLMGW_") for k in cmd.env)


def test_mig_indices_become_uuids() -> None:
    d = vllm_shard()
    d = d.model_copy(update={"spec": {**d.spec, "gpu_indices": [1000]}})
    p = prepare(d, REGISTRY, facts())
    assert p.launchable, p.error
    spec, cmds = build_launch(p, facts(), LaunchPorts(20001), runtime_dir="/x")
    assert spec.gpu_uuids == ("MIG-abc",)
    assert cmds[-1].env["CUDA_VISIBLE_DEVICES"] == "MIG-abc"


@pytest.mark.parametrize(
    ("desired", "policy", "needle"),
    [
        (vllm_shard(args=["--trust-remote-code"]), LocalPolicy(), "refused on this node"),
        (vllm_shard(args=["--trust-remote"]), LocalPolicy(), "refused on this node"),
        (vllm_shard(), LocalPolicy(allowed_engines=("sim",)), "not allowed on this node"),
        (
            vllm_shard(),
            LocalPolicy(allowed_model_roots=("/srv/models",)),
            "not under an allowed root",
        ),
        (
            vllm_shard(model_path="/srv/models/../../etc"),
            LocalPolicy(allowed_model_roots=("/srv/models",)),
            "not under",
        ),
        (
            vllm_shard(adapters=[{"name": "a", "path": "https://evil.example/a"}]),
            LocalPolicy(),
            "not an allowed download",
        ),
        (
            vllm_shard(adapters=[{"name": "a", "path": "/tmp/a"}]),
            LocalPolicy(allowed_adapter_sources=("/srv/lora",)),
            "not under an allowed root",
        ),
        (
            vllm_shard(secret_env={"HF_TOKEN": "env:SECRET_TEST_NOT_SET"}),
            LocalPolicy(),
            "does not have",
        ),
        (vllm_shard(tp="x"), LocalPolicy(), "profile.tp"),
        (vllm_shard(engine="nope"), LocalPolicy(), "unknown engine"),
    ],
)
def test_refusals_name_the_rule(desired: DesiredShard, policy: LocalPolicy, needle: str) -> None:
    p = prepare(desired, REGISTRY, facts(policy))
    assert not p.launchable and needle in p.error


def test_only_the_sim_engine_runs_on_simulated_gpus() -> None:
    d = vllm_shard()
    d = d.model_copy(update={"spec": {**d.spec, "gpu_indices": [2]}})
    assert "simulated" in prepare(d, REGISTRY, facts()).error
    s = sim_shard("s", extra_spec={"gpu_indices": [2]}, extra_profile={"gpu_class": "sim"})
    assert prepare(s, REGISTRY, facts()).launchable


def test_unknown_gpu_index_is_refused() -> None:
    d = vllm_shard()
    d = d.model_copy(update={"spec": {**d.spec, "gpu_indices": [7]}})
    assert "do not exist on this node" in prepare(d, REGISTRY, facts()).error


def test_allowed_roots_and_sources() -> None:
    assert under_root("/srv/models/x", ["/srv/models"])
    assert not under_root("/srv/models2/x", ["/srv/models"])
    assert not under_root("relative/x", ["/srv"])
    pol = LocalPolicy(allowed_adapter_sources=("/srv/lora", "https://hub.example/"))
    ok = vllm_shard(
        adapters=[
            {"name": "a", "path": "/srv/lora/a"},
            {"name": "b", "path": "https://hub.example/b"},
        ]
    )
    assert prepare(ok, REGISTRY, facts(pol)).launchable


def test_secret_references_resolve_on_the_node(tmp_path: Path) -> None:
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    got = resolve_secret_refs({"A": "env:MY_SECRET", "B": f"file:{f}"}, {"MY_SECRET": "from-env"})
    assert got == {"A": "from-env", "B": "from-file"}
    for ref, needle in (
        ("plain-value", "not a reference"),
        ("file:relative", "absolute"),
        (f"file:{tmp_path}/missing", "cannot read"),
        ("env:", "names no variable"),
        ("env:MY SECRET", "letters, digits and _"),
    ):
        with pytest.raises(SpecError, match=needle) as e:
            resolve_secret_refs({"X": ref}, {})
        assert "plain-value" not in str(e.value)  # never echo what may be a secret
    d = vllm_shard(secret_env={"HF_TOKEN": "env:MY_SECRET"})
    fx = facts(environ={"MY_SECRET": "s3cr3t-value", "PATH": "/usr/bin"})
    p = prepare(d, REGISTRY, fx)
    assert p.launchable, p.error
    _spec, cmds = build_launch(p, fx, LaunchPorts(20001), runtime_dir="/x")
    assert cmds[-1].env["HF_TOKEN"] == "s3cr3t-value"


def test_roce_gid_index_comes_from_the_nodes_fabric() -> None:
    from llmgw.protocol import FabricInfo

    fx = facts()
    fx = NodeFacts(
        gpus=fx.gpus,
        fabrics=(FabricInfo(name="roce-a", kind="roce", hcas=("mlx5_0",), gid_index=3),),
        mgmt_addr=fx.mgmt_addr,
        bind_addr=fx.bind_addr,
        policy=fx.policy,
        environ=fx.environ,
        base_env=fx.base_env,
    )
    d = vllm_shard()
    d = d.model_copy(update={"spec": {**d.spec, "fabric": "roce-a", "hcas": ["mlx5_0"]}})
    p = prepare(d, REGISTRY, fx)
    assert p.launchable, p.error
    spec, cmds = build_launch(p, fx, LaunchPorts(20001), runtime_dir="/x")
    assert spec.gid_index == 3 and cmds[-1].env["NCCL_IB_GID_INDEX"] == "3"
    assert cmds[-1].env["NCCL_IB_HCA"] == "mlx5_0"
