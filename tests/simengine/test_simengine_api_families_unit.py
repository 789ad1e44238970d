"""The pure halves of the Responses, Messages and embeddings routes: chat conversion, the
response store, stream events, usage and the pseudo-embeddings. No process, no engine."""

from __future__ import annotations

import base64
import json
import math
from array import array
from typing import Any

import pytest

from llmgw.errors import SpecError
from llmgw.simengine import embeddings as emb
from llmgw.simengine import messages as msgs
from llmgw.simengine import responses as resp


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        name_line, data_line = frame.split("\n")
        name = name_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


# ---- responses ------------------------------------------------------------------------------


def _request(**fields: Any) -> resp.ResponsesRequest:
    return resp.ResponsesRequest.model_validate(fields)


def test_input_becomes_chat_messages_as_vllm_builds_them() -> None:
    request = _request(
        instructions="Be brief.",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": "first"},
                    {"type": "output_text", "text": "dropped"},
                ],
            },
            {"role": "developer", "content": "plain"},
        ],
    )
    assert resp.input_messages(request, None) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "first"},
        {"role": "developer", "content": "plain"},
    ]
    assert resp.input_messages(_request(input="hi"), None) == [{"role": "user", "content": "hi"}]


def test_a_follow_up_is_the_history_then_its_output_then_the_new_input() -> None:
    first = _request(instructions="old rules", input="q1")
    body = resp.response_object(
        first,
        response_id="resp_1",
        created_at=0,
        model="sim",
        status="completed",
        output=[resp.message_item("msg_1", "a1", "completed")],
        usage=None,
        max_output_tokens=10,
    )
    store = resp.ResponseStore()
    store.put("resp_1", body, resp.input_messages(first, None))
    previous = store.get("resp_1")
    follow = _request(instructions="new rules", input="q2", previous_response_id="resp_1")
    # Instructions never carry over: the old system message is dropped, the new one leads.
    assert resp.input_messages(follow, previous) == [
        {"role": "system", "content": "new rules"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]


@pytest.mark.parametrize(
    "item",
    [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]},
        {"role": "user", "content": 3},
        {"content": "no role"},
    ],
)
def test_items_the_simulator_cannot_render_are_a_400_on_input(item: dict[str, Any]) -> None:
    with pytest.raises(SpecError) as caught:
        resp.input_messages(_request(input=[item]), None)
    assert caught.value.field == "input" and "input[0]" in caught.value.message


def test_background_needs_store_and_no_stream() -> None:
    with pytest.raises(SpecError, match="store=true"):
        _request(input="x", background=True, store=False).check()
    with pytest.raises(SpecError, match="stream"):
        _request(input="x", background=True, stream=True).check()


def test_only_function_tools_reach_the_template() -> None:
    tools: list[dict[str, Any]] = [
        {"type": "function", "name": "f", "parameters": {"type": "object"}, "extra": 1},
        {"type": "web_search_preview"},
    ]
    assert resp.chat_tools(tools) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert resp.chat_tools([{"type": "file_search"}]) is None


def _body(text: str) -> dict[str, Any]:
    return {"status": "completed", "output": [resp.message_item("m", text, "completed")]}


def test_the_store_evicts_least_recently_used_by_entries_and_by_characters() -> None:
    store = resp.ResponseStore(max_entries=2, max_chars=10**9)
    store.put("a", _body("x"), [])
    store.put("b", _body("x"), [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", _body("x"), [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2

    overhead = 1024
    store = resp.ResponseStore(max_entries=100, max_chars=2 * overhead + 150)
    store.put("a", _body("x" * 100), [])
    store.put("b", _body("y"), [{"role": "user", "content": "z" * 40}])
    assert len(store) == 2
    store.put("c", _body("w" * 10), [])  # over by the oldest's 100 characters
    assert store.get("a") is None and store.get("b") is not None
    # The newest entry stays even alone over the budget: its follow-up must find it.
    store.put("huge", _body("h" * 10_000), [])
    assert store.get("huge") is not None and len(store) == 1
    assert not store.update_body("gone", _body(""))
    assert store.update_body("huge", {"status": "cancelled", "output": []})
    entry = store.get("huge")
    assert entry is not None and entry.body["status"] == "cancelled"


def test_usage_has_vllms_fields_and_adds_up() -> None:
    usage = resp.response_usage(40, 7, 16, 16)
    assert usage["input_tokens"] == 40 and usage["output_tokens"] == 7
    assert usage["total_tokens"] == 47
    assert usage["input_tokens_details"]["cached_tokens"] == 16
    assert usage["input_tokens_details"]["cache_write_tokens"] == 16
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0


def test_a_response_object_reports_incomplete_for_length() -> None:
    body = resp.response_object(
        _request(input="x", temperature=0.5, metadata={"k": "v"}),
        response_id="resp_1",
        created_at=1,
        model="sim",
        status="incomplete",
        output=[],
        usage=None,
        max_output_tokens=5,
    )
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["temperature"] == 0.5 and body["top_p"] == 1.0
    assert body["object"] == "response" and body["metadata"] == {"k": "v"}


def test_stream_events_are_numbered_in_order() -> None:
    events = resp.ResponseEvents()
    raw = (
        events.opening({"id": "r", "status": "in_progress"})
        + events.text_started("msg_1")
        + events.text_delta(" a")
        + events.text_delta(" b")
        + events.text_done(" a b")
        + events.completed({"id": "r", "status": "completed"})
    )
    parsed = _events(raw)
    assert [name for name, _ in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in parsed] == list(range(len(parsed)))
    assert {data["item_id"] for name, data in parsed if "item_id" in data} == {"msg_1"}
    assert parsed[-2][1]["item"]["content"][0]["text"] == " a b"


# ---- messages -------------------------------------------------------------------------------


def _messages_request(**fields: Any) -> msgs.MessagesRequest:
    return msgs.MessagesRequest.model_validate({"model": "sim", "max_tokens": 5, **fields})


def test_anthropic_messages_become_chat_messages_as_vllm_converts_them() -> None:
    request = _messages_request(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
            {"type": "text", "text": "Be "},
            {"type": "text", "text": "terse."},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "one"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "user", "content": [{"type": "text", "text": ""}]},
            {"role": "assistant", "content": []},
            {"role": "user", "content": "plain"},
        ],
    )
    assert msgs.chat_messages(request) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "one"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "assistant"},
        {"role": "user", "content": "plain"},
    ]
    assert request.sampling_fields() == {}
    stopped = _messages_request(messages=[], stop_sequences=["\n"], temperature=0.0)
    assert stopped.sampling_fields() == {"stop": ["\n"], "temperature": 0.0}


def test_non_text_blocks_are_refused_naming_the_block() -> None:
    request = _messages_request(
        messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}
        ]
    )
    with pytest.raises(
        SpecError, match=r"messages\[0\]\.content\[0\] is a 'image' block"
    ) as caught:
        msgs.chat_messages(request)
    assert caught.value.field == "messages"


def test_tools_become_function_tools() -> None:
    request = _messages_request(
        messages=[], tools=[{"name": "get", "description": "d", "input_schema": {"properties": {}}}]
    )
    assert msgs.chat_tools(request) == [
        {
            "type": "function",
            "function": {
                "name": "get",
                "description": "d",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]


def test_stop_reasons_and_usage_follow_vllms_mapping() -> None:
    assert msgs.stop_reason_of("length", None) == ("max_tokens", None)
    assert msgs.stop_reason_of("stop", "END") == ("stop_sequence", "END")
    assert msgs.stop_reason_of("stop", 7) == ("end_turn", None)
    assert msgs.stop_reason_of("stop", None) == ("end_turn", None)
    usage = msgs.message_usage(40, 3, 16, 16)
    assert usage == {
        "input_tokens": 8,
        "output_tokens": 3,
        "cache_read_input_tokens": 16,
        "cache_creation_input_tokens": 16,
    }
    assert sum(usage[k] for k in usage if k != "output_tokens") == 40


def test_message_events_open_a_block_only_for_text() -> None:
    events = msgs.MessageEvents()
    raw = (
        events.start("msg_1", "sim", 12)
        + events.text(["", " a", " b"])
        + events.finish("end_turn", None, msgs.message_usage(12, 2, 0, 0))
    )
    names = [name for name, _ in _events(raw)]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    empty = msgs.MessageEvents()
    raw = empty.text([""]) + empty.finish("max_tokens", None, msgs.message_usage(1, 1, 0, 0))
    assert [name for name, _ in _events(raw)] == ["message_delta", "message_stop"]


def test_anthropic_errors_have_anthropics_shape() -> None:
    body = json.loads(msgs.error_body("nope", status=404))
    assert body == {"type": "error", "error": {"type": "not_found_error", "message": "nope"}}
    assert json.loads(msgs.error_body("x", status=500))["error"]["type"] == "api_error"


def test_messages_request_rules_are_vllms() -> None:
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        _messages_request(messages=[], max_tokens=0)
    with pytest.raises(ValueError, match="Model is required"):
        msgs.CountTokensRequest.model_validate({"model": "", "messages": []})


# ---- embeddings -----------------------------------------------------------------------------


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_embeddings_are_deterministic_unit_vectors() -> None:
    ids = [1000, 2000, 3000, 2000]
    first = emb.embedding(ids)
    assert first == emb.embedding(ids) and len(first) == emb.EMBEDDING_SIZE
    assert math.isclose(math.fsum(x * x for x in first), 1.0, rel_tol=1e-5)
    # A bag of tokens: order does not matter, a different bag does.
    assert emb.embedding(list(reversed(ids))) == first
    assert emb.embedding([1000, 2000, 3001]) != first


def test_texts_sharing_tokens_are_closer_than_texts_that_share_none() -> None:
    base = emb.embedding(list(range(100, 140)))
    overlapping = emb.embedding(list(range(100, 130)) + list(range(900, 910)))
    disjoint = emb.embedding(list(range(500, 540)))
    assert _cosine(base, overlapping) > 0.5 > abs(_cosine(base, disjoint))


def test_dimensions_keep_the_leading_coordinates_renormalised() -> None:
    ids = list(range(10, 60))
    full = emb.embedding(ids)
    short = emb.embedding(ids, 64)
    assert len(short) == 64
    assert math.isclose(math.fsum(x * x for x in short), 1.0, rel_tol=1e-5)
    norm = math.sqrt(math.fsum(x * x for x in full[:64]))
    assert all(
        math.isclose(s, f / norm, rel_tol=1e-4, abs_tol=1e-6)
        for s, f in zip(short, full[:64], strict=True)
    )
    # Every token reaches even the first coordinate: one dimension is +1 or -1.
    assert emb.embedding(ids, 1) in ([1.0], [-1.0])
    assert len({tuple(emb.embedding([t], 4)) for t in range(100, 200)}) > 10


def test_base64_is_native_float32_of_the_same_vector() -> None:
    vector = emb.embedding([7, 8, 9])
    encoded = emb.encode_embedding(vector, "base64")
    assert isinstance(encoded, str)
    assert list(array("f", base64.b64decode(encoded))) == vector
    assert emb.encode_embedding(vector, "float") is vector


def test_embeddings_request_rules() -> None:
    def request(**fields: Any) -> emb.EmbeddingsRequest:
        return emb.EmbeddingsRequest.model_validate({"input": "x", **fields})

    with pytest.raises(SpecError, match="only supports dimensions in range"):
        request(dimensions=0).check("sim")
    with pytest.raises(SpecError, match="encoding_format='bytes'"):
        request(encoding_format="bytes").check("sim")
    with pytest.raises(SpecError, match="at most 2048"):
        request(input=["a"] * 2049).check("sim")
    assert request(input=[1, 2]).prompts() == [[1, 2]]
    assert request(input=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert request(input=["a", "b"]).prompts() == ["a", "b"]
    assert request().prompts() == ["x"]
    body = emb.embeddings_object("sim", [[1.0]], 3)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 3
    assert body["data"] == [{"index": 0, "object": "embedding", "embedding": [1.0]}]
