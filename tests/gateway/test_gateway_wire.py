"""The request path's wire helpers: usage found without decoding the answer, SSE events
counted and their usage chunk captured/stripped, prompts read for routing, reservations."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.config import GatewaySettings
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.load import parse_max_model_len
from llmgw.gateway.wire import (
    StreamState,
    filter_events,
    prompt_of,
    reserve_tokens,
    usage_of,
)

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


@given(st.text(max_size=80))
def test_usage_is_found_whatever_the_text_holds(text: str) -> None:
    answer = {"choices": [{"text": text + ' "usage": {"prompt_tokens": 99}'}], "usage": USAGE}
    assert usage_of(json.dumps(answer).encode()) == USAGE
    assert usage_of(json.dumps({"choices": [{"text": text}]}).encode()) is None


def test_usage_of_garbage_is_none() -> None:
    assert usage_of(b"not json") is None
    assert usage_of(b'{"usage": 3}') is None


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_filter_events_counts_and_strips_usage_unless_asked() -> None:
    chunk = _event({"choices": [{"text": "a"}]})
    usage = _event({"choices": [], "usage": USAGE})
    done = b"data: [DONE]\n\n"
    state = StreamState()
    assert filter_events(chunk + chunk, state, False, lambda: 1.0) == chunk + chunk
    assert filter_events(usage + done, state, False, lambda: 2.0) == done
    assert (state.chunks, state.usage, state.first_at) == (2, USAGE, 1.0)
    kept = StreamState()
    assert filter_events(chunk + usage + done, kept, True, lambda: 3.0) == chunk + usage + done
    assert kept.usage == USAGE and kept.chunks == 1
    # A role-only chunk (sent before the prefill) is not a first token; a finish is.
    role = _event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    empty_finish = _event({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    tool = _event({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
    for token, at in ((chunk, 5.0), (empty_finish, 6.0), (tool, 7.0)):
        timed = StreamState()
        assert filter_events(role, timed, False, lambda: 4.0) == role
        assert timed.first_at is None and timed.chunks == 1
        filter_events(token + usage, timed, False, lambda t=at: t)  # type: ignore[misc]
        assert timed.first_at == at
    # A chunk with "usage": null is content, not the usage chunk.
    nulls = StreamState()
    with_null = _event({"choices": [{"text": "b"}], "usage": None})
    assert filter_events(with_null, nulls, False, lambda: 0.0) == with_null
    assert nulls.chunks == 1 and nulls.usage is None
    # Generated text that spells a usage object is content (its quotes arrive escaped).
    spelled = _event({"choices": [{"text": '"usage":{"prompt_tokens":1}'}]})
    assert filter_events(spelled, nulls, False, lambda: 0.0) == spelled
    assert nulls.chunks == 2 and nulls.usage is None
    # Compact JSON (vLLM's pydantic) is found as well as spaced JSON (json.dumps).
    compact = (
        b"data: " + json.dumps({"choices": [], "usage": USAGE}, separators=(",", ":")).encode()
    )
    assert filter_events(compact + b"\n\n", nulls, False, lambda: 0.0) == b""
    assert nulls.usage == USAGE


def test_prompt_of_reads_chat_text_and_flags_multimodal() -> None:
    p = prompt_of({"messages": [{"role": "system", "content": "be brief"}]}, chat=True)
    assert "be brief" in p.text and not p.multimodal
    image = {"type": "image_url", "image_url": {"url": "data:..."}}
    p = prompt_of(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]},
        chat=True,
    )
    assert p.multimodal and "hi" in p.text
    assert prompt_of({"prompt": [1, 2, 3]}, chat=False).token_ids == [1, 2, 3]
    # A longer conversation's text extends the shorter one's: prefixes stay prefixes.
    one = prompt_of({"messages": [{"role": "user", "content": "a"}]}, chat=True).text
    two = prompt_of(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        chat=True,
    ).text
    assert two.startswith(one)


@pytest.mark.parametrize(
    "body",
    [{"messages": []}, {"messages": "hi"}, {"messages": ["x"]}],
)
def test_prompt_of_refuses_bad_chat_bodies(body: dict[str, object]) -> None:
    with pytest.raises(GatewayError) as err:
        prompt_of(body, chat=True)
    assert err.value.status == 400 and err.value.param == "messages"


def test_reserve_tokens() -> None:
    s = GatewaySettings(default_max_tokens=1000)
    assert reserve_tokens({"max_tokens": 10}, True, s) == 10
    assert reserve_tokens({"max_completion_tokens": 7, "max_tokens": 10}, True, s) == 7
    assert reserve_tokens({}, True, s) == 1000
    assert reserve_tokens({}, False, s) == 16  # OpenAI's completions default
    assert reserve_tokens({"max_tokens": 10, "n": 3}, False, s) == 30
    # The model's context length known: what the engine may generate is the rest of it.
    assert reserve_tokens({}, True, s, context_limit=8192, prompt_tokens=192) == 8000
    assert reserve_tokens({}, True, s, context_limit=100, prompt_tokens=500) == 1
    assert reserve_tokens({"max_tokens": 10}, True, s, context_limit=8192) == 10
    assert reserve_tokens({}, False, s, context_limit=8192) == 16


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        (b'{"data":[{"id":"m","max_model_len":4096},{"id":"lora","max_model_len":4096}]}', 4096),
        (b'{"data":[{"id":"a","max_model_len":8192},{"id":"b","max_model_len":2048}]}', 2048),
        (b'{"data":[{"id":"m"}]}', None),
        (b'{"data":[{"id":"m","max_model_len":"4096"}]}', None),
        (b'{"data":[{"id":"m","max_model_len":0}]}', None),
        (b'{"data":{}}', None),
        (b"[]", None),
        (b"not json", None),
    ],
)
def test_parse_max_model_len(body: bytes, limit: int | None) -> None:
    assert parse_max_model_len(body) == limit
