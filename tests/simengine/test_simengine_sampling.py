"""Deterministic sampling, stop handling, timing model and the control state machine."""

from __future__ import annotations

import pytest

from llmgw.errors import ConfigError, ConflictError
from llmgw.simengine.control import EngineState, apply_signal
from llmgw.simengine.sampling import Sampler
from llmgw.simengine.timing import TimingModel
from llmgw.simengine.tokenizer import Tokenizer

TOKENIZER = Tokenizer()
SAMPLER = Sampler(TOKENIZER, default_seed=3)
PROMPT = TOKENIZER.tokenize("Tell me a story about a simulator.")


def test_same_prompt_and_seed_give_the_same_output_and_other_seeds_differ() -> None:
    a = SAMPLER.sample(PROMPT, max_tokens=20, room=1000, seed=11, temperature=0.8)
    b = SAMPLER.sample(PROMPT, max_tokens=20, room=1000, seed=11, temperature=0.8)
    c = SAMPLER.sample(PROMPT, max_tokens=20, room=1000, seed=12, temperature=0.8)
    assert a == b and a.token_ids != c.token_ids
    assert len(a.token_ids) == 20 and a.finish_reason == "length"
    assert TOKENIZER.detokenize(a.token_ids) == a.text


def test_temperature_zero_ignores_the_seed() -> None:
    a = SAMPLER.sample(PROMPT, max_tokens=8, room=1000, seed=1, temperature=0)
    b = SAMPLER.sample(PROMPT, max_tokens=8, room=1000, seed=2, temperature=0.0)
    assert a == b


def test_stop_string_cuts_text_before_it_and_ends_on_the_token_holding_it() -> None:
    full = SAMPLER.sample(PROMPT, max_tokens=40, room=1000)
    stop = full.text[20:24]  # spans a token boundary in general
    cut = SAMPLER.sample(PROMPT, max_tokens=40, room=1000, stop=[stop, "never-there"])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.find(stop)]
    assert len(cut.deltas) == len(cut.token_ids) < 40
    assert TOKENIZER.detokenize(cut.token_ids).startswith(cut.text + stop)


def test_stop_token_id_and_natural_length() -> None:
    full = SAMPLER.sample(PROMPT, max_tokens=10, room=1000)
    cut = SAMPLER.sample(PROMPT, max_tokens=10, room=1000, stop_token_ids=[full.token_ids[3]])
    assert cut.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3]) + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == full.token_ids[3]
    natural = SAMPLER.sample(PROMPT, max_tokens=None, room=1000)
    assert 16 <= len(natural.token_ids) <= 256 and natural.finish_reason == "stop"
    capped = SAMPLER.sample(PROMPT, max_tokens=None, room=5)
    assert len(capped.token_ids) <= 5 and capped.finish_reason == "length"


def test_timing_model_charges_uncached_prefill_and_decode_scaled() -> None:
    timing = TimingModel(
        step_overhead_ms=2, prefill_ms_per_token=0.5, decode_ms_per_seq=1, time_scale=0.1
    )
    assert timing.step_duration_s(100, 4) == pytest.approx((2 + 50 + 4) * 0.1 / 1000)
    with pytest.raises(ConfigError, match="time_scale"):
        TimingModel(time_scale=-1)


@pytest.mark.parametrize(
    ("state", "signal", "after"),
    [
        (EngineState.RUNNING, "pause", EngineState.PAUSED),
        (EngineState.PAUSED, "pause", EngineState.PAUSED),
        (EngineState.SUSPENDED, "pause", EngineState.SUSPENDED),
        (EngineState.PAUSED, "unpause", EngineState.RUNNING),
        (EngineState.PAUSED, "suspend", EngineState.SUSPENDED),
        (EngineState.SUSPENDED, "resume", EngineState.PAUSED),
    ],
)
def test_allowed_control_transitions(state: EngineState, signal: str, after: EngineState) -> None:
    assert apply_signal(state, signal) == after  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "signal"),
    [
        (EngineState.RUNNING, "unpause"),
        (EngineState.RUNNING, "suspend"),
        (EngineState.RUNNING, "resume"),
        (EngineState.SUSPENDED, "unpause"),
        (EngineState.PAUSED, "resume"),
    ],
)
def test_refused_control_transitions_name_the_way_out(state: EngineState, signal: str) -> None:
    with pytest.raises(ConflictError, match=f"cannot {signal} an engine that is {state.value}"):
        apply_signal(state, signal)  # type: ignore[arg-type]


def test_chunked_draw_with_stops_gives_the_tokens_of_one_draw() -> None:
    """With stops the output is drawn in chunks of 64, 128, ...; the tokens must not change."""
    full = SAMPLER.sample(PROMPT, max_tokens=5000, room=5000)
    never = SAMPLER.sample(PROMPT, max_tokens=5000, room=5000, stop=["~never~"])
    assert never.token_ids == full.token_ids and never.finish_reason == "length"
    # A stop string spanning the first chunk boundary (tokens 63 and 64) is still found.
    boundary = sum(len(d) for d in full.deltas[:64])
    stop = full.text[boundary - 2 : boundary + 2]
    cut = SAMPLER.sample(PROMPT, max_tokens=5000, room=5000, stop=[stop])
    assert cut.text == full.text[: full.text.find(stop)] and cut.stop_reason == stop
    assert len(cut.token_ids) <= 65


def test_the_first_stop_to_complete_wins_and_nothing_past_it_is_kept() -> None:
    full = SAMPLER.sample(PROMPT, max_tokens=3000, room=3000)
    early = full.token_ids[5]
    late_text = full.text[400:410]
    both = SAMPLER.sample(
        PROMPT, max_tokens=3000, room=3000, stop=[late_text], stop_token_ids=[early]
    )
    assert (
        both.stop_reason == early
        and both.token_ids == full.token_ids[: full.token_ids.index(early) + 1]
    )
    # A long stop that starts first but ends after a short one loses, as in vLLM.
    text = full.text
    start = next(
        i
        for i in range(0, 2000)
        if text.find(text[i : i + 14]) == i and text.find(text[i + 4 : i + 9]) == i + 4
    )
    long_stop, short_stop = text[start : start + 14], text[start + 4 : start + 9]
    short_wins = SAMPLER.sample(PROMPT, max_tokens=3000, room=3000, stop=[long_stop, short_stop])
    assert short_wins.stop_reason == short_stop and short_wins.text == text[: start + 4]


def test_max_tokens_beyond_the_room_is_refused_not_drawn() -> None:
    with pytest.raises(ValueError, match="exceeds the room"):
        SAMPLER.sample(PROMPT, max_tokens=10**9, room=100)
