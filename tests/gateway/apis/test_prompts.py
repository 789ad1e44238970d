"""Responses and Anthropic Messages bodies as the chat requests vLLM renders them, the fields
the gateway reserves from, and the bodies refused before any engine sees them.

The expected chat requests are vLLM 0.32's own (``construct_input_messages``,
``AnthropicServingMessages.to_chat_completion_request``, run on these bodies in the installed
CPU build and compared message by message: the same keys and values; key order is the chat
parser's business, it rebuilds each message)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.gateway.apis.prompts import (
    Refused,
    canonicalize,
    messages_chat,
    reserve,
    responses_chat,
)
from llmgw.gateway.wire import prompt_of

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


# --- Responses --------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    chat = responses_chat({"model": "m", "input": "hello", "instructions": "be brief"})
    _same(
        chat.body,
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello"},
            ]
        },
    )
    assert not chat.stored_history


def test_tool_calls_and_reasoning_merge_into_one_assistant_message() -> None:
    body = {
        "model": "m",
        "input": [
            {"role": "developer", "content": "dev says"},
            {"role": "user", "content": "weather?"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "thinking..."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "noon"},
            {"role": "assistant", "content": "It is sunny at noon."},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [
            WEATHER_TOOL,
            {
                "type": "function",
                "name": "get_time",
                "parameters": {"type": "object", "properties": {}},
                "strict": None,
            },
            {"type": "web_search"},  # never shown to the model
        ],
    }
    call = {"type": "function"}
    _same(
        responses_chat(body).body,
        {
            "messages": [
                {"role": "developer", "content": "dev says"},
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "reasoning": "thinking...",
                    "tool_calls": [
                        {
                            **call,
                            "id": "c1",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        },
                        {**call, "id": "c2", "function": {"name": "get_time", "arguments": "{}"}},
                    ],
                },
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                {"role": "tool", "content": "noon", "tool_call_id": "c2"},
                {"role": "assistant", "content": "It is sunny at noon."},
                {"role": "user", "content": "thanks"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "Weather",
                        "parameters": WEATHER_TOOL["parameters"],
                        "strict": True,
                    },
                },
                {
                    "type": "function",
                    "function": {
                        "name": "get_time",
                        "description": None,
                        "parameters": {"type": "object", "properties": {}},
                    },
                },
            ],
        },
    )


def test_an_unfinished_last_message_is_continued() -> None:
    body = {
        "input": [
            {"role": "user", "content": "continue this"},
            {
                "type": "message",
                "role": "assistant",
                "status": "incomplete",
                "content": [{"type": "output_text", "text": "Once upon"}],
            },
        ]
    }
    _same(
        responses_chat(body).body,
        {
            "messages": [
                {"role": "user", "content": "continue this"},
                {"role": "assistant", "content": "Once upon"},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )


def test_the_reasoning_effort_reaches_the_template_as_vllm_merges_it() -> None:
    low = responses_chat(
        {"input": "x", "reasoning": {"effort": "low"}, "chat_template_kwargs": {"foo": 1}}
    )
    assert low.body["chat_template_kwargs"] == {
        "foo": 1,
        "enable_thinking": True,
        "reasoning_effort": "low",
    }
    # The client's own enable_thinking stands; the request's fields override its kwargs.
    none = responses_chat(
        {
            "input": "x",
            "reasoning": {"effort": "none"},
            "chat_template_kwargs": {"enable_thinking": True, "add_generation_prompt": False},
        }
    )
    assert none.body["chat_template_kwargs"] == {
        "enable_thinking": True,
        "reasoning_effort": "none",
    }


def test_custom_tools_are_shown_as_vllms_one_string_function_and_images_stay_parts() -> None:
    body = {
        "input": [
            {"type": "custom_tool_call", "call_id": "k1", "name": "patch", "input": "diff --git"},
            {"type": "custom_tool_call_output", "call_id": "k1", "output": "ok"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "next"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                ],
            },
        ],
        "tools": [
            {"type": "custom", "name": "patch", "description": "apply a patch"},
            {
                "type": "namespace",
                "name": "fs",
                "tools": [{"type": "function", "name": "read", "parameters": {}}],
            },
        ],
    }
    chat = responses_chat(body).body
    assert chat["messages"][0]["tool_calls"][0]["function"] == {
        "name": "patch",
        "arguments": '{"input": "diff --git"}',
    }
    assert chat["messages"][2]["content"] == [
        {"type": "text", "text": "next"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
    ]
    assert [t["function"]["name"] for t in chat["tools"]] == ["patch", "fs__read"]
    assert chat["tools"][0]["function"]["parameters"]["required"] == ["input"]
    # The chat path counts the image: routed without a text prefix of its own.
    assert prompt_of(chat, chat=True).multimodal


def test_a_follow_up_says_its_history_is_stored_elsewhere() -> None:
    chat = responses_chat({"input": [], "previous_response_id": "resp_x"})
    assert chat.stored_history and chat.body == {"messages": []}


# --- Anthropic Messages -------------------------------------------------------------------


def test_system_blocks_are_joined_without_the_billing_header() -> None:
    body = {
        "max_tokens": 10,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: abc"},
            {"type": "text", "text": "You are "},
            {"type": "text", "text": "Claude."},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "twice"}],
            }
        ],
    }
    _same(
        messages_chat(body).body,
        {
            "messages": [
                {"role": "system", "content": "You are Claude."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "text", "text": "twice"},
                    ],
                },
            ]
        },
    )


def test_tool_use_and_results_become_tool_calls_and_tool_messages() -> None:
    body = {
        "max_tokens": 100,
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Let me check."},
                    {
                        "type": "tool_use",
                        "id": "tu1",
                        "name": "get_weather",
                        "input": {"city": "Paris", "ünï": 1},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "tu1",
                        "content": [
                            {"type": "text", "text": "sunny"},
                            {"type": "text", "text": "warm"},
                        ],
                    },
                    {"type": "text", "text": "and?"},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "x",
                        "content": [{"type": "text", "text": "odd"}],
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "tu2", "content": "plain"}],
            },
        ],
        "tools": [
            {
                "name": "get_weather",
                "description": "W",
                "input_schema": {"properties": {"city": {"type": "string"}}},
            },
            {"name": "other", "input_schema": {"type": "object"}, "strict": True},
        ],
    }
    _same(
        messages_chat(body).body,
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "reasoning": "hmm",
                    "content": "Let me check.",
                    "tool_calls": [
                        {
                            "id": "tu1",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                # json.dumps' defaults, as the engine writes them
                                "arguments": '{"city": "Paris", "\\u00fcn\\u00ef": 1}',
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "tu1", "content": "sunny\nwarm"},
                {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': 'odd'}]"},
                {"role": "tool", "tool_call_id": "tu2", "content": "plain"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "W",
                        "parameters": {
                            "properties": {"city": {"type": "string"}},
                            "type": "object",
                        },
                    },
                },
                {
                    "type": "function",
                    "function": {
                        "name": "other",
                        "description": None,
                        "parameters": {"type": "object"},
                        "strict": True,
                    },
                },
            ],
        },
    )


def test_inline_system_messages_stay_or_merge_as_the_template_needs() -> None:
    body = {
        "max_tokens": 10,
        "system": "top",
        "messages": [
            {"role": "system", "content": "inline sys"},
            {"role": "user", "content": "u"},
            {"role": "system", "content": [{"type": "text", "text": "again"}]},
            {"role": "user", "content": "v"},
        ],
    }
    kept = [(m["role"], m["content"]) for m in messages_chat(body).body["messages"]]
    assert kept == [
        ("system", "top"),
        ("system", "inline sys"),
        ("user", "u"),
        ("system", "again"),
        ("user", "v"),
    ]
    merged = messages_chat(body, merge_inline_system=True).body["messages"]
    assert [(m["role"], m["content"]) for m in merged] == [
        ("system", "topinline sysagain"),  # joined with nothing, as the engine joins them
        ("user", "u"),
        ("user", "v"),
    ]


def test_tool_additions_and_removals_apply_in_order() -> None:
    body = {
        "max_tokens": 10,
        "messages": [
            {
                "role": "system",
                "content": [
                    {
                        "type": "tool_addition",
                        "tool": {
                            "type": "tool_definition",
                            "definition": {"name": "late", "input_schema": {"type": "object"}},
                        },
                    },
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "gone"}},
                ],
            },
            {"role": "user", "content": "see"},
        ],
        "tools": [
            {"name": "gone", "input_schema": {"type": "object"}},
            {
                "name": "kept",
                "description": "k",
                "input_schema": {"type": "object"},
                "defer_loading": True,
            },
        ],
    }
    tools = messages_chat(body).body["tools"]
    assert [t["function"] for t in tools] == [
        {
            "name": "kept",
            "description": "k",
            "parameters": {"type": "object"},
            "defer_loading": True,
        },
        {"name": "late", "description": None, "parameters": {"type": "object"}},
    ]


@pytest.mark.parametrize(
    ("extra", "effort"),
    [
        ({"output_config": {"effort": "high"}}, "high"),
        # thinking disabled wins over the effort (the engine applies it second).
        ({"output_config": {"effort": "high"}, "thinking": {"type": "disabled"}}, "none"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, None),
    ],
)
def test_the_effort_the_template_sees(extra: dict[str, Any], effort: str | None) -> None:
    body = {"max_tokens": 4096, "messages": [{"role": "user", "content": "u"}], **extra}
    kwargs = messages_chat(body).body.get("chat_template_kwargs", {})
    assert kwargs.get("reasoning_effort") == effort


# --- refusals -----------------------------------------------------------------------------

# Each refused by vLLM 0.32 as well (pydantic, its conversion, or a 500 on the way).
RESPONSES_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
    ({"input": [{"type": "message", "role": "assistant", "content": []}]}, "input[0].content"),
    (
        {
            "input": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "refusal", "refusal": "no"}],
                }
            ]
        },
        "input[0].content",
    ),
    (
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zz"}]},
        "input[0].encrypted_content",
    ),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        "input[0].content[0].text",
    ),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "chat_template_kwargs": []}, "chat_template_kwargs"),
]
MESSAGES_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "document", "text": "x"}]}]},
        "messages[0].content[0]",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}}
                    ],
                }
            ]
        },
        "messages[0].content",
    ),
    (
        {
            "messages": [
                {
                    "role": "system",
                    "content": [
                        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}}
                    ],
                },
                {"role": "user", "content": "u"},
            ]
        },
        "messages",
    ),
    (
        {"messages": [{"role": "user", "content": "u"}], "tools": [{"name": "x"}]},
        "tools[0].input_schema",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content[0].text",
    ),
    (
        {
            "system": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}}],
            "messages": [{"role": "user", "content": "u"}],
        },
        "system",
    ),
    ({"messages": "hi"}, "messages"),
]


@pytest.mark.parametrize(("body", "field"), RESPONSES_REFUSED)
def test_a_responses_body_the_engine_refuses_is_refused(body: dict[str, Any], field: str) -> None:
    with pytest.raises(Refused) as refused:
        responses_chat(body)
    assert refused.value.field == field
    assert field.split("[")[0].split(".")[0] in refused.value.message


@pytest.mark.parametrize(("body", "field"), MESSAGES_REFUSED)
def test_a_messages_body_the_engine_refuses_is_refused(body: dict[str, Any], field: str) -> None:
    with pytest.raises(Refused) as refused:
        messages_chat(body)
    assert refused.value.field == field


def test_a_refusal_names_the_fix_and_never_echoes_the_value() -> None:
    secret = "sk-ant-api03-VERYSECRET"
    with pytest.raises(Refused) as refused:
        responses_chat({"input": "x", "instructions": {"key": secret}})
    assert refused.value.message == (
        "`instructions` must be a string (the system prompt) or null; got an object"
    )
    with pytest.raises(Refused) as refused:
        canonicalize("messages", {"max_tokens": secret})
    assert secret not in refused.value.message


# --- fields and reservations --------------------------------------------------------------


def test_fields_are_read_as_the_engine_reads_them_and_written_back() -> None:
    body: dict[str, Any] = {"max_tokens": "250", "stream": "no"}
    canonicalize("messages", body)
    assert body == {"max_tokens": 250, "stream": False}
    assert reserve("messages", body) == 250
    responses: dict[str, Any] = {"max_output_tokens": 64.0, "stream": "true"}
    canonicalize("responses", responses)
    assert responses == {"max_output_tokens": 64, "stream": True}
    assert reserve("responses", responses) == 64


@pytest.mark.parametrize(
    ("api", "body", "field"),
    [
        ("messages", {}, "max_tokens"),  # required by Anthropic's API
        ("messages", {"max_tokens": None}, "max_tokens"),
        ("messages", {"max_tokens": 0}, "max_tokens"),
        ("messages", {"max_tokens": 2.5}, "max_tokens"),
        ("messages", {"max_tokens": 9, "stream": "maybe"}, "stream"),
        ("responses", {"max_output_tokens": 0}, "max_output_tokens"),
        ("responses", {"max_output_tokens": "many"}, "max_output_tokens"),
    ],
)
def test_a_field_no_rule_reads_is_refused(api: Any, body: dict[str, Any], field: str) -> None:
    with pytest.raises(Refused) as refused:
        canonicalize(api, body)
    assert refused.value.field == field and f"`{field}`" in refused.value.message


def test_what_each_family_reserves() -> None:
    assert reserve("responses", {}) is None  # the context less the prompt, as for chat
    assert reserve("responses", {"max_output_tokens": None}) is None
    for api in ("count_tokens", "embeddings", "rerank", "score"):
        assert reserve(api, {"max_tokens": 99}) == 0
    with pytest.raises(Refused):
        reserve("messages", {})
    with pytest.raises(ValueError, match="wire"):
        reserve("chat", {})


# --- properties ---------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
PART = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            [
                "text",
                "input_text",
                "image",
                "tool_use",
                "tool_result",
                "thinking",
                "output_text",
                "refusal",
                "input_image",
                "tool_addition",
                "tool_removal",
            ]
        )
        | JSON,
        "text": JSON,
        "tool": JSON,
        "content": JSON,
        "input": JSON,
        "source": JSON,
    }
)
MESSAGE = st.fixed_dictionaries(
    {"content": st.text(max_size=8) | st.lists(PART | JSON, max_size=3) | JSON},
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | JSON,
        "type": st.sampled_from(
            [
                "message",
                "reasoning",
                "function_call",
                "function_call_output",
                "custom_tool_call",
                "custom_tool_call_output",
                "item_reference",
            ]
        )
        | JSON,
        "call_id": st.text(max_size=4) | JSON,
        "name": st.text(max_size=4) | JSON,
        "arguments": st.text(max_size=4) | JSON,
        "output": st.text(max_size=4) | st.lists(PART, max_size=2) | JSON,
        "summary": st.lists(PART, max_size=2) | JSON,
        "status": st.sampled_from(["in_progress", "incomplete", "completed"]) | JSON,
    },
)
TOOL = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["function", "custom", "namespace", "web_search"]) | JSON,
        "name": st.text(max_size=4) | JSON,
        "description": st.text(max_size=4) | JSON,
        "parameters": JSON,
        "input_schema": JSON,
        "strict": JSON,
        "defer_loading": JSON,
        "tools": st.lists(JSON, max_size=2),
    },
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "input": st.text(max_size=8) | st.lists(MESSAGE | JSON, max_size=4),
        "messages": st.lists(MESSAGE | JSON, max_size=4),
        "system": JSON | st.lists(PART, max_size=2),
        "instructions": JSON,
        "tools": JSON | st.lists(TOOL | JSON, max_size=3),
        "reasoning": JSON,
        "output_config": JSON,
        "thinking": JSON,
        "chat_template_kwargs": JSON,
    },
)


@given(BODY)
def test_any_body_converts_or_is_refused_and_is_left_as_it_came(body: dict[str, Any]) -> None:
    before = copy.deepcopy(body)
    for convert in (responses_chat, messages_chat):
        try:
            chat = convert(body)
        except Refused as exc:
            assert exc.field  # names the field
            continue
        json.dumps(chat.body)  # plain JSON, for the chat path and /tokenize
        assert isinstance(chat.body["messages"], list)
    assert body == before


@given(
    st.lists(
        st.tuples(st.sampled_from(["user", "assistant"]), st.text(max_size=20)),
        min_size=1,
        max_size=6,
    ),
    st.text(max_size=20),
)
def test_text_conversations_read_as_chat_with_every_word_kept(
    turns: list[tuple[str, str]], system: str
) -> None:
    anthropic = messages_chat(
        {"system": system, "messages": [{"role": r, "content": t} for r, t in turns]}
    )
    responses = responses_chat(
        {"instructions": system, "input": [{"role": r, "content": t} for r, t in turns]}
    )
    for chat in (anthropic, responses):
        prompt = prompt_of(chat.body, chat=True)
        assert not prompt.multimodal
        for _, text in turns:
            assert text in prompt.text
