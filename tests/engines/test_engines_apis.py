"""Which API families a profile's model serves (``Engine.served_apis``, what the gateways' route
table reads): the profile's own ``apis`` where it lists any, else its engine's default (vLLM's
from its runner flags, the simulator both, every other engine generation); the field's one rule;
and that it never enters the fingerprint or the command line: it changes which requests the
gateways send the process, not the process."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from llmgw.engines import (
    API_GENERATE,
    API_GROUPS,
    API_POOLING,
    ENGINE_NAMES,
    Profile,
    ShardSpec,
    apis_problem,
    profile_fingerprint,
    reference_engine,
)
from tests.engines.engines_testkit import build, profile, spec

GEN = frozenset({API_GENERATE})
POOL = frozenset({API_POOLING})
BOTH = frozenset(API_GROUPS)


def _served(engine: str, *args: str, **extra: Any) -> frozenset[str]:
    fields: dict[str, Any] = {"name": "p", "engine": engine, "model_path": "/models/m"}
    p = Profile.model_validate({**fields, "args": list(args), **extra})
    return reference_engine(engine).served_apis(p)


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ((), GEN),
        # vLLM 0.32's spellings (vllm/engine/arg_utils.py: --runner, --convert), as its parser
        # takes them: `=`, `_` for `-`, an unambiguous prefix.
        (("--runner", "pooling"), POOL),
        (("--runner=pooling",), POOL),
        (("--run", "pooling"), POOL),
        (("--runner", "generate"), GEN),
        (("--runner", "auto"), GEN),  # by the architecture, which llmgw does not read
        (("--runner", "draft"), GEN),
        (("--runner", "Pooling"), GEN),  # vLLM refuses it: its choices are case-sensitive
        # The last spelling wins, as argparse keeps it.
        (("--runner", "pooling", "--runner", "generate"), GEN),
        (("--runner", "generate", "--runner=pooling"), POOL),
        # Under `--runner auto` a --convert to a pooling model means pooling (vLLM's
        # ModelConfig._get_runner_type); an explicit runner decides alone.
        (("--convert", "embed"), POOL),
        (("--convert=classify",), POOL),
        (("--convert", "reward"), POOL),  # the releases before 0.32
        (("--convert", "none"), GEN),
        (("--runner", "auto", "--convert", "embed"), POOL),
        (("--runner", "generate", "--convert", "embed"), GEN),
        (("--runner", "pooling", "--convert", "none"), POOL),
        # An older build's --task.
        (("--task", "embed"), POOL),
        (("--task=embedding",), POOL),
        (("--task", "score"), POOL),
        (("--task", "reward"), POOL),
        (("--task", "classify"), POOL),
        (("--task", "generate"), GEN),
        (("--runner", "generate", "--task", "embed"), GEN),
        # Other flags are not runner flags, whatever their values say.
        (("--max-model-len", "4096", "--served-model-name-x", "pooling"), GEN),
        (("--tokenizer", "pooling"), GEN),
    ],
)
def test_vllm_serves_pooling_where_its_args_choose_the_pooling_runner(
    args: tuple[str, ...], want: frozenset[str]
) -> None:
    assert _served("vllm", *args) == want


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_each_engines_default(engine: str) -> None:
    extra = {"gpu_class": "cpu"} if engine == "llamacpp" else {}
    want = BOTH if engine == "sim" else GEN
    assert _served(engine, **extra) == want
    # vLLM's runner flag means nothing to another engine's default.
    if engine not in ("vllm", "sim"):
        assert _served(engine, "--runner", "pooling", **extra) == GEN


@pytest.mark.parametrize(
    ("engine", "args", "apis", "want"),
    [
        ("vllm", ("--runner", "pooling"), ("generate",), GEN),
        ("vllm", (), ("pooling",), POOL),
        ("vllm", (), ("pooling", "generate"), BOTH),
        ("sim", (), ("pooling",), POOL),
        ("sim", (), ("generate",), GEN),
        ("sglang", (), ("pooling",), POOL),
    ],
)
def test_the_profiles_own_list_wins(
    engine: str, args: tuple[str, ...], apis: tuple[str, ...], want: frozenset[str]
) -> None:
    assert _served(engine, *args, apis=list(apis)) == want


@pytest.mark.parametrize(
    "apis", [(), ("generate",), ("pooling",), ("generate", "pooling"), ("pooling", "generate")]
)
def test_a_profile_takes_known_families_each_once(apis: tuple[str, ...]) -> None:
    assert apis_problem(apis) is None
    assert profile(apis=list(apis)).apis == apis


@pytest.mark.parametrize(
    ("apis", "message"),
    [
        (["embeddings"], "Input should be 'generate' or 'pooling'"),
        (["Generate"], "Input should be 'generate' or 'pooling'"),
        ([""], "Input should be 'generate' or 'pooling'"),
        (["generate", "generate"], "lists 'generate' twice: give each API family once"),
        (["pooling", "generate", "pooling"], "lists 'pooling' twice"),
    ],
)
def test_anything_else_is_refused_naming_the_values(apis: list[str], message: str) -> None:
    with pytest.raises(ValidationError, match="apis") as info:
        profile(apis=apis)
    assert message in str(info.value)


def test_the_rule_names_the_families_it_takes() -> None:
    problem = apis_problem(["embeddings"])
    assert problem is not None
    assert "'embeddings' is no API family: each must be one of generate, pooling" in problem
    problem = apis_problem(["x" * 500])
    assert problem is not None and "x" * 33 not in problem  # checked, not echoed whole


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_apis_are_not_in_the_fingerprint_nor_the_command(engine: str) -> None:
    base: dict[str, Any] = {"name": "p", "engine": engine, "model_path": "/models/m"}
    if engine in ("llamacpp", "sim"):
        base["gpu_class"] = "cpu"
    p = Profile.model_validate(base)
    before = profile_fingerprint(p)
    commands = [c.to_json_dict() for c in build(spec(p))]
    for apis in (["generate"], ["pooling"], ["pooling", "generate"]):
        q = Profile.model_validate({**base, "apis": apis})
        assert profile_fingerprint(q) == before, (engine, apis)
        assert [c.to_json_dict() for c in build(spec(q))] == commands, (engine, apis)


def test_a_launch_spec_carries_the_list_through_json() -> None:
    s = spec(profile(apis=["pooling"]))
    again = ShardSpec.model_validate_json(s.model_dump_json())
    assert again.profile.apis == ("pooling",)
    # A launch spec written before the field existed reads as "the engine's default".
    doc = s.model_dump(mode="json")
    del doc["profile"]["apis"]
    assert ShardSpec.model_validate(doc).profile.apis == ()


@pytest.mark.parametrize(
    ("args", "env", "stored"),
    [
        ((), {}, "1"),
        # A pooling process serves no Responses: nothing to store.
        (("--runner", "pooling"), {}, None),
        # The profile's env wins: an operator who will not hold responses in engine memory.
        ((), {"VLLM_ENABLE_RESPONSES_API_STORE": "0"}, "0"),
    ],
)
def test_a_generating_vllm_keeps_its_responses_for_follow_ups(
    args: tuple[str, ...], env: dict[str, str], stored: str | None
) -> None:
    # Off, vLLM refuses `store: true` and every previous_response_id, GET and cancel fails.
    p = profile(args=list(args), env=env)
    for command in build(spec(p)):
        assert command.env.get("VLLM_ENABLE_RESPONSES_API_STORE") == stored, command.name
