"""Usage of every family as one triple: from whole answers (found without decoding them) and
from streams read event by event, however the engine's reads cut them."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.gateway.apis.usage import Usage, normalise, stream_reader, usage_of
from llmgw.gateway.wire import StreamState, settle


def test_each_shape_counts_the_prompt_whole() -> None:
    assert normalise(
        "chat",
        {
            "prompt_tokens": 10,
            "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    ) == Usage(10, 4, 8)
    assert normalise(
        "responses",
        {
            "input_tokens": 10,
            "output_tokens": 4,
            "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
        },
    ) == Usage(10, 4, 8)
    # Anthropic's input_tokens leaves the cache's tokens out: the prompt is the sum.
    assert normalise(
        "messages",
        {
            "input_tokens": 2,
            "output_tokens": 4,
            "cache_read_input_tokens": 8,
            "cache_creation_input_tokens": 1,
        },
    ) == Usage(11, 4, 8)
    assert normalise("messages", {"input_tokens": 10, "output_tokens": 4}) == Usage(10, 4, 0)
    # Pooling generates nothing, whatever its usage says.
    assert normalise("embeddings", {"prompt_tokens": 7, "completion_tokens": 3}) == Usage(7, 0, 0)
    assert normalise("rerank", {"prompt_tokens": 7, "total_tokens": 7}) == Usage(7, 0, 0)


@pytest.mark.parametrize("bad", [-1, 2.5, "3", None, True, [1], {"n": 1}])
def test_a_count_that_is_not_a_non_negative_int_is_zero(bad: object) -> None:
    assert normalise("responses", {"input_tokens": bad, "output_tokens": 2}) == Usage(0, 2, 0)
    assert normalise("messages", {"input_tokens": 3, "cache_read_input_tokens": bad}) == Usage(
        3, 0, 0
    )


def test_as_openai_is_what_settle_reads() -> None:
    got: dict[str, int] = {}

    class Admission:
        def settle(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
            got.update(p=prompt_tokens, c=completion_tokens, k=cached_tokens)

        def release(self) -> None: ...

    settle(Admission(), Usage(11, 4, 8).as_openai(), completion_fallback=0, prompt_fallback=0)
    assert got == {"p": 11, "c": 4, "k": 8}


# --- whole answers ------------------------------------------------------------------------


def _responses_answer(text: str) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}],
        "usage": {
            "input_tokens": 12,
            "output_tokens": 3,
            "total_tokens": 15,
            "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
        "user": None,
    }


def _messages_answer(text: str) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": "m",
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 9, "output_tokens": 5, "cache_read_input_tokens": 3},
    }


@given(st.text(max_size=60))
def test_a_whole_answers_usage_is_found_whatever_its_text_holds(text: str) -> None:
    sneaky = text + ' "usage": {"input_tokens": 999, "prompt_tokens": 999}'
    assert usage_of("responses", json.dumps(_responses_answer(sneaky)).encode()) == Usage(12, 3, 4)
    assert usage_of("messages", json.dumps(_messages_answer(sneaky)).encode()) == Usage(12, 5, 3)


def test_an_embeddings_answer_is_read_from_its_usage_alone() -> None:
    answer = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": [0.1] * 256} for i in range(8)],
        "usage": {"prompt_tokens": 40, "total_tokens": 40, "completion_tokens": 0},
    }
    assert usage_of("embeddings", json.dumps(answer).encode()) == Usage(40, 0, 0)
    rerank = {
        "results": [{"index": 0, "relevance_score": 0.9}],
        "usage": {"prompt_tokens": 6, "total_tokens": 6},
    }
    assert usage_of("rerank", json.dumps(rerank).encode()) == Usage(6, 0, 0)


def test_a_usage_found_elsewhere_than_last_is_still_found() -> None:
    # The usage first, then a later object with a "usage" key of another shape: whole decode.
    answer = {"usage": {"input_tokens": 3, "output_tokens": 1}, "metadata": {"usage": {"x": 1}}}
    assert usage_of("responses", json.dumps(answer).encode()) == Usage(3, 1, 0)


@pytest.mark.parametrize(
    ("api", "raw"),
    [
        ("count_tokens", b'{"input_tokens": 12}'),  # a count, not a use
        ("responses", b"not json"),
        ("responses", b'{"usage": null}'),
        ("messages", b"[1, 2]"),
        ("embeddings", b'{"data": []}'),
    ],
)
def test_no_usage(api: Any, raw: bytes) -> None:
    assert usage_of(api, raw) is None


# --- streams ------------------------------------------------------------------------------


def _event(name: str, data: dict[str, Any], *, named: bool = True) -> bytes:
    head = f"event: {name}\n" if named else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def _responses_stream(*, named: bool = True, terminal: str = "response.completed") -> list[bytes]:
    response = {"id": "resp_1", "object": "response", "status": "in_progress", "usage": None}
    done = {
        **response,
        "status": "completed",
        "output": [
            {
                "type": "message",
                "content": [{"type": "output_text", "text": 'Hi "usage": {"input_tokens": 99}'}],
            }
        ],
        "usage": {
            "input_tokens": 20,
            "output_tokens": 3,
            "input_tokens_details": {"cached_tokens": 16},
        },
    }
    return [
        _event("response.created", {"type": "response.created", "response": response}, named=named),
        _event(
            "response.in_progress",
            {"type": "response.in_progress", "response": response},
            named=named,
        ),
        _event(
            "response.output_item.added",
            {"type": "response.output_item.added", "item": {"type": "message", "id": "msg_1"}},
            named=named,
        ),
        *(
            _event(
                "response.output_text.delta",
                {"type": "response.output_text.delta", "delta": d, "item_id": "msg_1"},
                named=named,
            )
            for d in ("Hi", ' "us', 'age"')
        ),
        _event(terminal, {"type": terminal, "response": done}, named=named),
    ]


def _messages_stream(*, named: bool = True, delta_usage: dict[str, int]) -> list[bytes]:
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "m",
            "usage": {"input_tokens": 20, "output_tokens": 0},
        },
    }
    return [
        _event("message_start", start, named=named),
        _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            named=named,
        ),
        *(
            _event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": t},
                },
                named=named,
            )
            for t in ("a", "b")
        ),
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}, named=named),
        _event(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": delta_usage},
            named=named,
        ),
        _event("message_stop", {"type": "message_stop"}, named=named),
    ]


def _feed(api: Any, events: list[bytes], cuts: list[int]) -> StreamState:
    """The events fed as the relay feeds them: in reads cut between events at ``cuts``."""
    reader = stream_reader(api)
    state = StreamState()
    ticks = iter(range(1, 100))
    bounds = [0, *sorted(set(cuts)), len(events)]
    for lo, hi in itertools.pairwise(bounds):
        batch = b"".join(events[lo:hi])
        assert reader(batch, state, False, lambda: float(next(ticks))) == batch  # as it came
    return state


@given(st.lists(st.integers(0, 8), max_size=8), st.booleans())
def test_a_responses_streams_usage_is_its_terminal_events(cuts: list[int], named: bool) -> None:
    state = _feed("responses", _responses_stream(named=named), cuts)
    assert state.usage == Usage(20, 3, 16).as_openai()
    assert state.chunks == 3  # the deltas, the fallback for a cut stream
    assert state.first_at == 1.0  # the first delta, never an earlier event


@pytest.mark.parametrize("terminal", ["response.incomplete", "response.failed"])
def test_an_unfinished_response_is_settled_from_its_own_usage(terminal: str) -> None:
    state = _feed("responses", _responses_stream(terminal=terminal), [])
    assert state.usage == Usage(20, 3, 16).as_openai()


def test_a_response_that_failed_before_any_usage_leaves_the_fallback() -> None:
    failed = _event(
        "response.failed", {"type": "response.failed", "response": {"id": "resp_1", "usage": None}}
    )
    state = _feed("responses", [*_responses_stream()[:4], failed], [])
    assert state.usage is None and state.chunks == 1


@pytest.mark.parametrize(
    ("delta_usage", "want"),
    [
        # vLLM: the final counts, input split from the cache's as Anthropic's API defines it.
        ({"input_tokens": 4, "output_tokens": 2, "cache_read_input_tokens": 16}, Usage(20, 2, 16)),
        # Anthropic's older form: only the output count in message_delta.
        ({"output_tokens": 2}, Usage(20, 2, 0)),
    ],
)
@given(cuts=st.lists(st.integers(0, 7), max_size=7), named=st.booleans())
def test_a_messages_streams_usage_is_its_start_and_delta(
    delta_usage: dict[str, int], want: Usage, cuts: list[int], named: bool
) -> None:
    state = _feed("messages", _messages_stream(named=named, delta_usage=delta_usage), cuts)
    assert state.usage == want.as_openai()
    assert state.chunks == 2 and state.first_at == 1.0


def test_a_messages_stream_cut_before_its_delta_has_no_usage_yet() -> None:
    state = _feed("messages", _messages_stream(delta_usage={"output_tokens": 2})[:3], [])
    assert state.usage is None and state.chunks == 1


def test_a_reader_per_stream() -> None:
    a, b = stream_reader("messages"), stream_reader("messages")
    assert a is not b
    with pytest.raises(ValueError, match="filter_events"):
        stream_reader("chat")
