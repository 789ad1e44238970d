"""Each engine's default admission ceiling, read from its own batch flag, and the rule that
max_in_flight never enters the fingerprint."""

from __future__ import annotations

import pytest

from llmgw.engines import Profile, default_max_in_flight, max_in_flight, profile_fingerprint
from llmgw.errors import SpecError


def _profile(engine: str, *args: str, **extra: object) -> Profile:
    return Profile.model_validate(
        {"name": "p", "engine": engine, "model_path": "/m", "args": list(args), **extra}
    )


@pytest.mark.parametrize(
    ("engine", "args", "want"),
    [
        ("vllm", (), 256 + 128),
        ("vllm", ("--max-num-seqs", "64"), 96),
        ("vllm", ("--max-num-seqs=64", "--data-parallel-size", "2"), 192),
        ("sim", (), 384),
        ("sim", ("--max-num-seqs", "8"), 12),
        ("sglang", ("--max-running-requests", "100"), 150),
        ("trtllm", (), 2048 + 1024),
        ("llamacpp", (), 1 + 4),
        ("llamacpp", ("-np", "8"), 12),
    ],
)
def test_default_from_the_engines_batch_flag(engine: str, args: tuple[str, ...], want: int) -> None:
    assert default_max_in_flight(_profile(engine, *args)) == want


def test_profile_value_wins_and_a_bad_flag_names_the_fix() -> None:
    assert max_in_flight(_profile("vllm", max_in_flight=40)) == 40
    with pytest.raises(SpecError, match="--max-num-seqs 'many' is not a whole number"):
        default_max_in_flight(_profile("vllm", "--max-num-seqs", "many"))


def test_max_in_flight_is_not_in_the_fingerprint() -> None:
    a = _profile("sim")
    assert profile_fingerprint(a) == profile_fingerprint(_profile("sim", max_in_flight=7))
