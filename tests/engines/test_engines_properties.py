"""Properties over generated shard specs, for every engine and topology."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.engines import (
    UNSAFE_ENV,
    Adapter,
    Command,
    KVHashParams,
    Profile,
    ShardSpec,
    unsafe_env_reason,
)
from tests.engines.engines_testkit import registry

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_name = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,11}", fullmatch=True)
# Variable names: ordinary ones, and every kind of unsafe one.
_env_name = st.one_of(
    st.from_regex(r"[A-Z][A-Z0-9_]{0,15}", fullmatch=True),
    st.sampled_from(sorted(UNSAFE_ENV)),
    st.sampled_from(
        ["LD_FOO", "LLMGW_SHARD_ID", "LLMGW_X", "BASH_FUNC_f%%", "DYLD_INSERT_LIBRARIES"]
    ),
)
_value = st.text(min_size=0, max_size=12)
# Keys long enough to be told apart from everything else on a command line.
_api_key = st.one_of(
    st.just(""),
    st.text(alphabet="abcdefXYZ0123456789", min_size=16, max_size=40).map(lambda s: "sk-" + s),
)


@st.composite
def shard_specs(draw: st.DrawFn) -> ShardSpec:
    engine = draw(st.sampled_from(["vllm", "sglang", "llamacpp", "trtllm", "megatron", "sim"]))
    multi = engine in ("vllm", "sglang", "trtllm", "megatron")
    cpu = engine in ("llamacpp", "sim") and draw(st.booleans())
    nodes = draw(st.integers(1, 3)) if multi else 1
    per_node = 0 if cpu else draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([1, 2])) if engine != "llamacpp" and not cpu else 1
    total = per_node * nodes
    if not cpu and total % pp:
        pp = 1
    tp = 1 if cpu else total // pp
    kv_events = engine in ("vllm", "sim") and draw(st.booleans())
    adapters = (
        ()
        if engine == "megatron"
        else draw(
            st.lists(
                st.builds(Adapter, name=_name, path=_name.map(lambda s: "/l/" + s)),
                max_size=3,
                unique_by=lambda a: a.name,
            )
        )
    )
    prof = Profile(
        name=draw(_name),
        engine=engine,
        gpu_class="cpu" if cpu else "h100",
        tp=tp,
        pp=pp,
        nodes=nodes,
        gpus_per_node=per_node if nodes > 1 else 0,
        model_path="/models/" + draw(_name),
        served_model_name=draw(st.one_of(st.just(""), _name)),
        env=draw(st.dictionaries(_env_name, _value, max_size=6)),
        secret_env=draw(st.dictionaries(_env_name, _name, max_size=3)),
        adapters=tuple(adapters),
        kv_events=kv_events,
        kv_hash=KVHashParams(
            seed=str(draw(st.integers(min_value=1, max_value=2**32 - 1))),
            block_size=draw(st.sampled_from([16, 32])),
        ),
        multinode_backend=draw(st.sampled_from(["ray", "native"])),
        args=draw(
            st.lists(
                st.sampled_from(["--max-model-len", "4096", "--enforce-eager", "-v"]), max_size=3
            )
        ),
    )
    rank = draw(st.integers(0, nodes - 1))
    mig = not cpu and per_node == 1 and nodes == 1 and draw(st.booleans())
    indices = tuple(draw(st.permutations(range(8)))[:per_node]) if not mig else (1000,)
    hcas = tuple(
        draw(
            st.lists(
                st.sampled_from(["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]), unique=True, max_size=4
            )
        )
    )
    return ShardSpec(
        replica_id="rep-" + draw(_name),
        shard_id="shard-" + draw(_name),
        rank=rank,
        nnodes=nodes,
        leader_addr="10.0.0.1",
        leader_port=29500,
        node_addr=f"10.0.0.{rank + 1}",
        peer_addrs=tuple(f"10.0.0.{i + 1}" for i in range(nodes)),
        gpu_indices=indices,
        gpu_uuids=("MIG-" + draw(_name),) if mig else (),
        hcas=hcas,
        gid_index=draw(st.one_of(st.none(), st.integers(0, 7))) if hcas else None,
        mgmt_interface=draw(st.sampled_from(["", "eth0"])),
        fabric=draw(st.sampled_from(["", "ib:a", "nvl:rack"])),
        http_port=draw(st.integers(1024, 65535)),
        kv_events_port=draw(st.integers(1024, 65535)) if kv_events else 0,
        kv_replay_port=draw(st.integers(0, 65535)) if kv_events else 0,
        api_key=draw(_api_key),
        secret_env={k: "secret-" + draw(_name) for k in prof.secret_env},
        threads=draw(st.integers(0, 32)) if cpu else 0,
        profile=prof,
    )


_base = st.dictionaries(_env_name, _value, max_size=6)


def commands_of(spec: ShardSpec, base: dict[str, str]) -> list[Command]:
    return registry().get(spec.profile.engine).commands(spec, base_env=base)


@SETTINGS
@given(shard_specs(), _base)
def test_the_api_key_never_appears_in_any_argv(spec: ShardSpec, base: dict[str, str]) -> None:
    for c in commands_of(spec, base):
        if spec.api_key:
            assert not any(spec.api_key in a for a in c.argv)
        for secret in spec.secret_env.values():
            assert not any(secret in a for a in c.argv)


@SETTINGS
@given(shard_specs(), _base)
def test_cuda_visible_devices_matches_the_specs_devices(
    spec: ShardSpec, base: dict[str, str]
) -> None:
    want = ",".join(spec.gpu_uuids) if spec.gpu_uuids else ",".join(map(str, spec.gpu_indices))
    for c in commands_of(spec, base):
        assert c.env["CUDA_VISIBLE_DEVICES"] == want
        assert c.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


@SETTINGS
@given(shard_specs(), _base)
def test_nccl_ib_hca_only_lists_the_specs_hcas(spec: ShardSpec, base: dict[str, str]) -> None:
    for c in commands_of(spec, base):
        if spec.hcas:
            assert c.env["NCCL_IB_HCA"].split(",") == list(spec.hcas)
            assert c.env["NCCL_IB_DISABLE"] == "0"
        else:
            assert "NCCL_IB_HCA" not in c.env
            assert c.env["NCCL_IB_DISABLE"] == spec.profile.env.get("NCCL_IB_DISABLE", "1")


@SETTINGS
@given(shard_specs(), _base)
def test_no_unsafe_variable_from_a_profile_or_secret_reaches_an_environment(
    spec: ShardSpec, base: dict[str, str]
) -> None:
    # The same shard with no profile env and no secrets: what llmgw and the node set.
    bare = spec.model_copy(
        update={"profile": spec.profile.model_copy(update={"env": {}}), "secret_env": {}}
    )
    unsafe = [n for n in (*spec.profile.env, *spec.secret_env) if unsafe_env_reason(n)]
    for c, ref in zip(commands_of(spec, base), commands_of(bare, base), strict=True):
        assert not any(k.startswith("LLMGW_") for k in c.env)
        for name in unsafe:
            assert c.env.get(name) == ref.env.get(name), name


@SETTINGS
@given(shard_specs(), _base)
def test_commands_are_deterministic_sorted_and_round_trip_json(
    spec: ShardSpec, base: dict[str, str]
) -> None:
    first = commands_of(spec, base)
    shipped = ShardSpec.model_validate_json(spec.model_dump_json())
    assert shipped == spec
    again = commands_of(shipped, dict(reversed(list(base.items()))))
    assert first == again
    for c in first:
        assert list(c.env) == sorted(c.env)
        assert Command.model_validate(json.loads(c.model_dump_json())) == c
