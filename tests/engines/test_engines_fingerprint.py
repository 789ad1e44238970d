"""Profile fingerprints change with every launch-relevant edit and with nothing else."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llmgw.engines import Adapter, KVHashParams, Profile, profile_fingerprint
from llmgw.errors import SpecError
from tests.engines.engines_testkit import profile

BASE: dict[str, Any] = {
    "name": "llama-h100",
    "engine": "vllm",
    "gpu_class": "h100",
    "tp": 2,
    "model_path": "/models/llama",
    "served_model_name": "llama",
    "args": ["--max-model-len", "8192", "--enforce-eager"],
    "env": {"NCCL_DEBUG": "INFO", "HF_HOME": "/cache"},
    "secret_env": {"HF_TOKEN": "secret://hf"},
    "adapters": [{"name": "a", "path": "/l/a"}, {"name": "b", "path": "/l/b"}],
    "kv_events": True,
    "kv_hash": {"seed": "1001", "block_size": 16},
}


def fp(**changes: Any) -> str:
    return profile_fingerprint(Profile.model_validate({**BASE, **changes}))


def test_is_hex_sha256_and_stable() -> None:
    value = fp()
    assert re.fullmatch(r"[0-9a-f]{64}", value)
    assert fp() == value


@pytest.mark.parametrize(
    "change",
    [
        {"engine": "sglang", "kv_events": False},
        {"model_path": "/models/llama-2"},
        {"served_model_name": "llama-prod"},
        {"gpu_class": "a100"},
        {"tp": 4, "gpus_per_node": 4},
        {"pp": 2, "gpus_per_node": 4},
        {"nodes": 2, "gpus_per_node": 1},
        {"args": ["--enforce-eager", "--max-model-len", "8192"]},  # order counts
        {"args": ["--max-model-len", "8193", "--enforce-eager"]},
        {"args": ["--max-model-len  8192", "--enforce-eager"]},  # whitespace is content
        {"args": ["--max-model-len", "8192", "--enforce-eager", ""]},
        {"env": {"NCCL_DEBUG": "WARN", "HF_HOME": "/cache"}},
        {"adapters": [{"name": "b", "path": "/l/b"}, {"name": "a", "path": "/l/a"}]},
        {"adapters": [{"name": "a", "path": "/l/a2"}, {"name": "b", "path": "/l/b"}]},
        {"kv_events": False},
        {"kv_hash": {"seed": "1002", "block_size": 16}},
        {"kv_hash": {"seed": "1001", "block_size": 32}},
        {"nodes": 2, "gpus_per_node": 1, "multinode_backend": "native"},
        {"args": ["--data-parallel-size", "2"], "kv_events": False},
        {"secret_env": {"HF_TOKEN": "secret://hf", "WANDB_API_KEY": "secret://wandb"}},
    ],
)
def test_launch_relevant_changes_change_it(change: dict[str, Any]) -> None:
    assert fp(**change) != fp()


@pytest.mark.parametrize(
    "change",
    [
        {"name": "renamed"},
        {"secret_env": {"HF_TOKEN": "secret://hf-rotated"}},  # a secret's reference or value
        {"env": {"HF_HOME": "/cache", "NCCL_DEBUG": "INFO"}},  # dict order
        {"pp": 0},  # pp 0 launches PP 1
        {"gpus_per_node": 2},  # 0 means TP x PP
        # vLLM reads none of these unless they reach its command line:
        {"threads": 8},  # a GPU engine's threads
        {"multinode_backend": "native"},  # one node: no backend to choose
        {"kv_hash": {"seed": "1001", "block_size": 16, "extra_key_format": "legacy"}},
        {"model": "llama"},  # served_model_name is set, so the model's name is unused
    ],
)
def test_irrelevant_changes_do_not(change: dict[str, Any]) -> None:
    assert fp(**change) == fp()


def test_served_name_defaults_to_the_models_name_alike() -> None:
    assert fp(served_model_name="", model="llama") == fp(served_model_name="llama")
    assert fp(served_model_name="", model="llama") != fp(served_model_name="/models/llama")


def test_kv_hash_seed_counts_only_where_the_engine_gets_it() -> None:
    # Issue 8 item 10: with kv_events off no command carries the seed, so a new
    # seed must not roll replicas; with it on, PYTHONHASHSEED changes.
    off = {"kv_events": False}
    assert fp(**off, kv_hash={"seed": "1002"}) == fp(**off, kv_hash={"seed": "1001"})
    assert fp(kv_hash={"seed": "1002"}) != fp(kv_hash={"seed": "1001"})
    assert fp(**off, threads=4) == fp(**off)


def test_a_profile_its_engine_refuses_has_no_fingerprint() -> None:
    with pytest.raises(SpecError, match="kv_events"):
        fp(engine="sglang")


def test_the_source_documents_format_does_not_count() -> None:
    as_json = json.dumps(BASE, indent=4, sort_keys=True)
    as_yaml = yaml.safe_dump(dict(reversed(list(BASE.items()))), default_flow_style=False)
    compact = json.dumps(BASE, separators=(",", ":"))
    values = {
        profile_fingerprint(Profile.model_validate(json.loads(as_json))),
        profile_fingerprint(Profile.model_validate(yaml.safe_load(as_yaml))),
        profile_fingerprint(Profile.model_validate_json(compact)),
    }
    assert values == {fp()}


_text = st.text(max_size=10)


def _launchable(p: Profile) -> bool:
    try:
        profile_fingerprint(p)
    except SpecError:
        return False
    return True


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(st.from_regex(r"[A-Z_]{1,8}", fullmatch=True), _text, max_size=6), st.randoms()
)
def test_env_order_never_counts(env: dict[str, str], rnd: Any) -> None:
    assume(_launchable(profile(env=env)))
    items = list(env.items())
    rnd.shuffle(items)
    assert profile_fingerprint(profile(env=env)) == profile_fingerprint(profile(env=dict(items)))


@settings(max_examples=40, deadline=None)
@given(st.lists(_text, max_size=5), st.lists(_text, max_size=5))
def test_args_count_exactly(a: list[str], b: list[str]) -> None:
    assume(all(_launchable(profile(args=x)) for x in (a, b)))
    same = profile_fingerprint(profile(args=a)) == profile_fingerprint(profile(args=b))
    assert same == (a == b)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.from_regex(r"[a-z]{1,4}", fullmatch=True), _text.filter(bool)), max_size=4
    ),
    st.integers(min_value=1, max_value=2**32 - 2).map(str),
)
def test_adapters_and_seed_count_exactly(adapters: list[tuple[str, str]], seed: str) -> None:
    ads = [Adapter(name=n, path=p) for n, p in adapters]
    assume(len({a.name for a in ads}) == len(ads))
    one = profile(adapters=ads, kv_events=True, kv_hash=KVHashParams(seed=seed))
    assert profile_fingerprint(one) == profile_fingerprint(
        Profile.model_validate_json(one.model_dump_json())
    )
    if len(ads) > 1 and ads[0] != ads[-1]:
        swapped = profile(
            adapters=[ads[-1], *ads[1:-1], ads[0]], kv_events=True, kv_hash=KVHashParams(seed=seed)
        )
        assert profile_fingerprint(swapped) != profile_fingerprint(one)
    other_seed = profile(
        adapters=ads, kv_events=True, kv_hash=KVHashParams(seed=str(int(seed) + 1))
    )
    assert profile_fingerprint(other_seed) != profile_fingerprint(one)
