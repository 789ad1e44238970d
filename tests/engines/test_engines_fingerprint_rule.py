"""The fingerprint rule, as a property over every adapter (issue 8 item 10).

For two profiles and ONE placement (the same shard ids, ports, GPU indices,
addresses, API key, secret values and inherited environment for both):

    fingerprint(a) == fingerprint(b)
        <=>  every rank's commands (program, argv, complete env, files) are equal
             and placement_requirements(a) == placement_requirements(b)

Secret values are never compared (both profiles get the placement's values for
the secret names they list). Profile b is a's copy with a few fields redrawn
from small pools, so equal and unequal processes both come up often, and the
fields that matter only sometimes (the KV seed without kv_events, threads on a
GPU, the backend of a one-node replica) are exercised.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from llmgw.engines import (
    EngineRegistry,
    EnginesConfig,
    Profile,
    ShardSpec,
    SimConfig,
    TRTLLMConfig,
    placement_requirements,
    profile_fingerprint,
)
from llmgw.errors import SpecError

_REG = EngineRegistry(
    EnginesConfig(
        sim=SimConfig(python_executable="/py"), trtllm=TRTLLMConfig(serve_path="trtllm-serve")
    )
)
_MULTI = {"vllm", "sglang", "trtllm", "megatron"}
_KV = {"vllm", "sim"}
_CPU = {"llamacpp", "sim", "vllm"}

_POOLS: dict[str, st.SearchStrategy[Any]] = {
    "model_path": st.sampled_from(["/m/a", "/m/b"]),
    "model": st.sampled_from(["", "alpha", "/m/a"]),
    "served_model_name": st.sampled_from(["", "alpha", "chat"]),
    "gpu_class": st.sampled_from(["h100", "a100", "cpu"]),
    "tp": st.sampled_from([1, 2]),
    "pp": st.sampled_from([0, 1, 2]),
    "nodes": st.sampled_from([1, 1, 2]),
    "gpus_per_node": st.sampled_from([0, 0, 1, 2, 4]),
    "args": st.sampled_from(
        [[], ["--max-model-len", "4096"], ["--enforce-eager"], ["-dp", "2"], ["--dp-size", "2"]]
    ),
    "env": st.sampled_from(
        [{}, {"NCCL_DEBUG": "INFO"}, {"NCCL_DEBUG": "WARN"}, {"VLLM_CPU_KVCACHE_SPACE": "2"}]
    ),
    "secret_env": st.sampled_from([{}, {"HF_TOKEN": "ref-1"}, {"HF_TOKEN": "ref-2"}]),
    "adapters": st.sampled_from([[], [{"name": "x", "path": "/l/x"}]]),
    "kv_events": st.booleans(),
    "threads": st.sampled_from([0, 0, 4]),
    "kv_hash": st.fixed_dictionaries(
        {
            "seed": st.sampled_from(["11", "12"]),
            "block_size": st.sampled_from([16, 32]),
            "extra_key_format": st.sampled_from(["tagged", "legacy"]),
        }
    ),
    "multinode_backend": st.sampled_from(["ray", "native"]),
}


@st.composite
def _profile_pair(draw: st.DrawFn) -> tuple[Profile, Profile]:
    engine = draw(
        st.sampled_from(sorted(["vllm", "sglang", "llamacpp", "trtllm", "megatron", "sim"]))
    )
    fields = {k: draw(s) for k, s in _POOLS.items()}
    other = dict(fields)
    # Weighted towards fields that matter only sometimes, where the old
    # fingerprint was wrong.
    keys = sorted(_POOLS) + ["kv_hash", "threads", "multinode_backend", "model", "pp"] * 3
    for k in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3)):
        other[k] = draw(_POOLS[k])
    pair = []
    for f in (fields, other):
        f = dict(f)
        if engine not in _MULTI:
            f["nodes"] = 1
        if f["nodes"] > 1 and f["gpus_per_node"] == 0:
            f["gpus_per_node"] = f["tp"] * max(f["pp"], 1) // 2 or 1
        if engine not in _KV:
            f["kv_events"] = False
        if engine not in _CPU and f["gpu_class"] == "cpu":
            f["gpu_class"] = "h100"
        try:
            p = Profile.model_validate({"name": "p", "engine": engine, **f})
            _REG.get(engine).validate(p, [])
        except (SpecError, ValueError):
            assume(False)
        pair.append(p)
    return pair[0], pair[1]


_placement = st.fixed_dictionaries(
    {
        "http_port": st.integers(1024, 65535),
        "kv_events_port": st.integers(1024, 65535),
        "api_key": st.sampled_from(["", "sk-placement-key-123456"]),
        "first_gpu": st.integers(0, 3),
        "base_env": st.sampled_from([{}, {"PATH": "/bin", "HF_HOME": "/hf"}]),
        "secret": st.sampled_from(["s3cret-value-1", "s3cret-value-2"]),
        # The cores an agent picked for a CPU shard: a placement choice, never in the fingerprint.
        "cpu_cores": st.sampled_from([[], [0, 1, 2, 3], [8, 9]]),
    }
)


def _commands(p: Profile, pl: dict[str, Any]) -> list[list[dict[str, Any]]]:
    eng = _REG.get(p.engine)
    gpus = eng.gpus_per_shard(p)
    out = []
    for rank in range(p.num_nodes):
        multi = p.num_nodes > 1
        s = ShardSpec.model_validate(
            {
                "replica_id": "rep",
                "shard_id": f"shard-{rank}",
                "rank": rank,
                "nnodes": p.num_nodes,
                "leader_addr": "192.168.1.10" if multi else "",
                "leader_port": 6379 if multi else 0,
                "node_addr": f"192.168.1.{10 + rank}" if multi else "",
                "peer_addrs": [f"192.168.1.{10 + r}" for r in range(p.num_nodes)] if multi else [],
                "gpu_indices": list(range(pl["first_gpu"], pl["first_gpu"] + gpus)),
                "hcas": ["mlx5_3"] if multi else [],
                "http_port": pl["http_port"],
                "kv_events_port": pl["kv_events_port"] if p.kv_events else 0,
                "api_key": pl["api_key"],
                "secret_env": {n: pl["secret"] for n in p.secret_env},
                "cpu_cores": pl["cpu_cores"] if p.cpu_only else [],
                "profile": p,
            }
        )
        out.append([c.to_json_dict() for c in eng.commands(s, base_env=pl["base_env"])])
    return out


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(_profile_pair(), _placement)
def test_equal_fingerprint_iff_equal_processes(
    pair: tuple[Profile, Profile], placement: dict[str, Any]
) -> None:
    a, b = pair
    same_fp = profile_fingerprint(a) == profile_fingerprint(b)
    same_req = placement_requirements(a) == placement_requirements(b)
    same_processes = same_req and _commands(a, placement) == _commands(b, placement)
    event(f"same fingerprint: {same_fp}, same profile: {a == b}")
    assert same_fp == same_processes, (a, b)


def test_the_seed_without_kv_events_is_the_case_from_the_issue() -> None:
    base = {"name": "p", "engine": "vllm", "model_path": "/m", "model": "m"}
    one = Profile.model_validate({**base, "kv_hash": {"seed": "11"}})
    two = Profile.model_validate({**base, "kv_hash": {"seed": "12"}})
    pl = {"http_port": 8000, "kv_events_port": 1, "api_key": "", "first_gpu": 0,
          "base_env": {}, "secret": "x", "cpu_cores": []}  # fmt: skip
    assert _commands(one, pl) == _commands(two, pl)
    assert profile_fingerprint(one) == profile_fingerprint(two)


def test_the_cpu_kv_cache_size_rolls_replicas_and_the_cores_do_not() -> None:
    base = {"name": "p", "engine": "vllm", "model_path": "/m", "model": "m", "gpu_class": "cpu",
            "threads": 4}  # fmt: skip
    one = Profile.model_validate(base)
    two = Profile.model_validate({**base, "env": {"VLLM_CPU_KVCACHE_SPACE": "2"}})
    assert profile_fingerprint(one) != profile_fingerprint(two)
    pl = {"http_port": 8000, "kv_events_port": 1, "api_key": "", "first_gpu": 0,
          "base_env": {}, "secret": "x"}  # fmt: skip
    assert _commands(one, {**pl, "cpu_cores": [0, 1, 2, 3]}) != _commands(
        one, {**pl, "cpu_cores": [4, 5, 6, 7]}
    )  # where it runs, not what: the fingerprint has no cores in it
