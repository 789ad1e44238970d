"""What a profile's env and secret_env may not set or name (hardening-3 finding 16): the
variables that point an engine at files of the profile author's choosing (PATH, HOME,
OPENSSL_CONF, the compiled-code caches), and references to llmgw's own secrets."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.engines import parse_secret_ref, shard_env, unsafe_env_reason
from llmgw.errors import SpecError
from tests.engines.engines_testkit import BASE_ENV, build, profile, registry, spec

# The five the run found, and the same kinds of variable.
REFUSED = [
    "HOME", "OPENSSL_CONF", "PATH", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR",
    "TMPDIR", "TMP", "TEMP", "OPENSSL_ENGINES", "OPENSSL_MODULES", "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_HOME", "TRITON_PTXAS_PATH", "TRITON_LIBCUDA_PATH", "CC", "CXX", "VLLM_CACHE_ROOT",
    "VLLM_LOGGING_CONFIG_PATH", "HF_MODULES_CACHE", "NCCL_CONF_FILE", "LOCPATH",
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_DIRS", "PYTHONPLATLIBDIR",
    "PYTHONEXECUTABLE", "PYTHONSOMETHINGNEW", "NODE_OPTIONS", "PERL5OPT", "JAVA_TOOL_OPTIONS",
    "LD_PRELOAD", "LD_ANYTHING", "PYTHONPATH", "LLMGW_SHARD_ID", "SOMETOOL_CONFIG_FILE",
]  # fmt: skip
# What profiles set for good reasons stays settable.
ALLOWED = [
    "NCCL_DEBUG", "NCCL_IB_DISABLE", "HF_HOME", "HF_HUB_OFFLINE", "VLLM_USE_V1",
    "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM", "HOMEBREW_X", "PATHOLOGY",
]  # fmt: skip


@pytest.mark.parametrize("name", REFUSED)
def test_path_and_loader_variables_are_refused(name: str) -> None:
    assert unsafe_env_reason(name), name


@pytest.mark.parametrize("name", ALLOWED)
def test_ordinary_variables_stay_settable(name: str) -> None:
    assert unsafe_env_reason(name) is None, name


def _validate(**kw: Any) -> list[str]:
    p = profile(**kw)
    return registry().get(p.engine).validate(p, [])


@pytest.mark.parametrize("field", ["env", "secret_env"])
@pytest.mark.parametrize("name", ["PATH", "HOME", "OPENSSL_CONF", "TRITON_CACHE_DIR"])
def test_a_profile_setting_one_is_refused_naming_the_field_and_the_reason(
    field: str, name: str
) -> None:
    value = "env:SOME_SECRET" if field == "secret_env" else "/tmp/evil"
    with pytest.raises(SpecError) as info:
        _validate(**{field: {name: value}})
    assert info.value.field == f"profile.{field}"
    assert f"{field} may not set {name}: " in info.value.message
    assert "remove it" in info.value.message


def test_the_launch_drops_them_even_from_a_profile_stored_before() -> None:
    # A profile stored before the rule: its PATH never reaches the engine, the node's does.
    p = profile(env={"PATH": "/tmp/evil", "HOME": "/tmp/evil", "NCCL_DEBUG": "INFO"})
    s = spec(p)
    assert "PATH" not in shard_env(s) and "HOME" not in shard_env(s)
    assert shard_env(s)["NCCL_DEBUG"] == "INFO"
    (command, *_) = build(s)
    assert command.env["PATH"] == BASE_ENV["PATH"] and command.env["HOME"] == BASE_ENV["HOME"]


@pytest.mark.parametrize(
    "ref",
    [
        "env:LLMGW_CONTROLPLANE__ADMIN_TOKEN",
        "env:LLMGW_AGENT__BOOTSTRAP_TOKEN",
        "env:llmgw_controlplane__database_url",  # llmgw's settings read the env case-blind
        "file:/proc/self/environ",
        "file:/proc/1/environ",
        "file:/sys/class/x",
        "file:/dev/stdin",
        "file:/run/secrets/../../proc/self/environ",
    ],
)
def test_references_to_llmgws_own_secrets_are_refused(ref: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_secret_ref("HF_TOKEN", ref)
    assert info.value.field == "profile.secret_env.HF_TOKEN"
    assert "HF_TOKEN" in info.value.message
    assert (
        "env:HF_TOKEN" in info.value.message or "file:/run/secrets/hf_token" in info.value.message
    )


@pytest.mark.parametrize("ref", ["env:HF_TOKEN", "env:MY_LLMGW_KEY", "file:/run/secrets/hf"])
def test_ordinary_references_pass(ref: str) -> None:
    assert parse_secret_ref("HF_TOKEN", ref).target in ref
