"""Where each engine reads its tokenizer files (``Engine.tokenizer_dir``, what the agent ships for
the gateways), the profile's ``tokenizer`` field's one rule, and that the field never enters the
fingerprint: it changes what the agent ships beside the process, not the process."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from llmgw.engines import (
    ENGINE_NAMES,
    TOKENIZER_NONE,
    Profile,
    profile_fingerprint,
    reference_engine,
    tokenizer_problem,
)
from llmgw.engines.sim import TINY_MODEL_DIR, TOKENIZER_BUILTIN, TOKENIZER_TINY
from llmgw.simengine.hf_tokens import tiny_model_dir
from tests.engines.engines_testkit import build, profile, registry, spec


def _dir(engine: str, *args: str, **extra: Any) -> str | None:
    p = Profile.model_validate(
        {"name": "p", "engine": engine, "model_path": "/models/m", "args": list(args), **extra}
    )
    return reference_engine(engine).tokenizer_dir(p)


@pytest.mark.parametrize(
    ("engine", "args", "want"),
    [
        # The engine's own tokenizer flag in any spelling its parser takes, else model_path.
        ("vllm", (), "/models/m"),
        ("vllm", ("--tokenizer", "/models/tok"), "/models/tok"),
        ("vllm", ("--tokenizer=/models/tok",), "/models/tok"),
        ("vllm", ("--tokenizer-mode", "slow"), "/models/m"),
        ("sglang", ("--tokenizer-path", "/models/tok"), "/models/tok"),
        ("sglang", (), "/models/m"),
        ("trtllm", ("--tokenizer", "/models/tok"), "/models/tok"),
        # llama-server reads its vocabulary from the GGUF file: nothing to ship.
        ("llamacpp", (), None),
        ("llamacpp", ("--ctx-size", "4096"), None),
        # The simulator: the packaged tiny model unless its args name other files.
        ("sim", (), TINY_MODEL_DIR),
        ("sim", ("--tokenizer", TOKENIZER_TINY), TINY_MODEL_DIR),
        ("sim", ("--tokenizer", TOKENIZER_BUILTIN), None),
        ("sim", (f"--tokenizer={TOKENIZER_BUILTIN}",), None),
        ("sim", ("--tokenizer", "/models/tok"), "/models/tok"),
    ],
)
def test_each_engine_says_where_its_tokenizer_files_are(
    engine: str, args: tuple[str, ...], want: str | None
) -> None:
    assert _dir(engine, *args) == want


def test_the_tiny_model_is_the_packaged_one() -> None:
    assert (tiny_model_dir() / "tokenizer.json").is_file()
    assert str(tiny_model_dir()) == TINY_MODEL_DIR


def test_the_sim_command_and_its_tokenizer_dir_agree() -> None:
    """The adapter passes `--tokenizer tiny` exactly where tokenizer_dir answers the tiny model:
    the one place the simulator's keywords are read."""
    for args in ([], ["--tokenizer", "tiny"], ["--tokenizer", "builtin"]):
        p = profile(engine="sim", gpu_class="cpu", model_path="sim://demo", args=args)
        [c] = build(spec(p))
        i = c.args.index("--tokenizer")
        named = c.args[i + 1]
        assert args == [] or list(c.args[i : i + 2]) == args
        expected = TINY_MODEL_DIR if named == TOKENIZER_TINY else None
        assert registry().get("sim").tokenizer_dir(p) == expected


@pytest.mark.parametrize("value", ["", TOKENIZER_NONE, "/", "/models/llama-3-8b/tokenizer"])
def test_a_profile_takes_empty_none_or_an_absolute_path(value: str) -> None:
    assert tokenizer_problem(value) is None
    assert profile(tokenizer=value).tokenizer == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("None", "the keyword is 'none', in lower case"),
        ("NONE", "the keyword is 'none', in lower case"),
        ("auto", "must be the absolute path of a directory on the node"),
        ("models/tok", "must be the absolute path of a directory on the node"),
        ("~/tok", "must be the absolute path of a directory on the node"),
        (" /models/tok", "must be the absolute path of a directory on the node"),
        ("/models/tok\nX=1", "must not hold a NUL character or a line break"),
        ("/models/tok\r", "must not hold a NUL character or a line break"),
        ("/models/\x00tok", "must not hold a NUL character or a line break"),
    ],
)
def test_anything_else_is_refused_naming_the_fix(value: str, message: str) -> None:
    problem = tokenizer_problem(value)
    assert problem is not None and message in problem
    assert value not in problem or value == ""  # checked, never echoed
    with pytest.raises(ValidationError, match="tokenizer"):
        profile(tokenizer=value)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_the_tokenizer_is_not_in_the_fingerprint(engine: str) -> None:
    base: dict[str, Any] = {"name": "p", "engine": engine, "model_path": "/models/m"}
    if engine == "llamacpp":
        base["gpu_class"] = "cpu"
    before = profile_fingerprint(Profile.model_validate(base))
    for value in (TOKENIZER_NONE, "/models/other-tokenizer"):
        after = profile_fingerprint(Profile.model_validate({**base, "tokenizer": value}))
        assert after == before, (engine, value)
