"""Anthropic's Messages API in the simulator: the requests, their chat messages, the message
object, its stream events, its usage and its errors.

vLLM serves `/v1/messages` by converting the request into a chat completion and converting
the answer back (vllm/entrypoints/anthropic/serving.py); the simulator does the same, so a
message is rendered by the chat template, cached and scheduled exactly as the equivalent chat
is. Followed from vLLM 0.32 (anthropic/protocol.py and serving.py):

- the conversion: `system` (a string or text blocks, joined with no separator, Claude Code's
  `x-anthropic-billing-header` block dropped) becomes the first system message; a block list
  of one text block becomes a plain string; empty text blocks are skipped and a user message
  left with no content is dropped; `stop_sequences` becomes `stop`; tools become function tools;
- usage (`_build_anthropic_usage`): `input_tokens` is the prompt *minus* the cached and the
  newly cached tokens, which are reported as `cache_read_input_tokens` and
  `cache_creation_input_tokens` (the engine runs with --enable-prompt-tokens-details), so the
  three add up to the prompt; `message_start` carries the whole prompt as `input_tokens`;
- stop reasons (`_to_anthropic_stop_reason`): length is `max_tokens`, a matched stop string is
  `stop_sequence` (named in `stop_sequence`), anything else `end_turn`;
- streams: `message_start`, then per text delta `content_block_start` (first delta only) and
  `content_block_delta`, then `content_block_stop`, `message_delta` and `message_stop`, each
  as `event: <type>` plus its JSON; `count_tokens` answers `input_tokens` and vLLM's
  `context_management`.

Where the simulator differs: ids are `msg_...` (Anthropic's form; vLLM reuses the chat id);
the non-streamed body carries `stop_sequence: null` (Anthropic's; vLLM drops None fields);
every error on these routes (validation and 401 included, which vLLM answers in OpenAI's
shape) is in Anthropic's shape; content blocks other than text are refused (400).

Must NOT touch the engine or sockets (api_routes.py does), nor tokenize.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from llmgw.errors import SpecError, clip

__all__ = [
    "CountTokensRequest",
    "MessageEvents",
    "MessagesRequest",
    "StopReason",
    "chat_messages",
    "chat_tools",
    "error_body",
    "message_object",
    "message_usage",
    "new_message_id",
    "stop_reason_of",
]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]

# Claude Code puts a per-request hash in a system block that starts so; vLLM drops the block
# because it would defeat prefix caching (serving.py _convert_system_message).
_BILLING_HEADER: Final = "x-anthropic-billing-header"

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(message: str, *, status: int) -> bytes:
    kind = _ERROR_TYPES.get(status, "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[_Block]


class _Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class _RequestBase(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[_Message]
    system: str | list[_Block] | None = None
    tools: list[_Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("model")
    @classmethod
    def _model_named(cls, value: str) -> str:
        if not value:
            raise ValueError("Model is required")
        return value


class CountTokensRequest(_RequestBase):
    """`/v1/messages/count_tokens`: what the messages render to, without generating."""


class MessagesRequest(_RequestBase):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    cache_salt: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("max_tokens must be positive")
        return value

    def sampling_fields(self) -> dict[str, Any]:
        """The fields a chat completion takes, as chat names them (only those sent)."""
        sent = self.model_dump(
            include={"temperature", "top_p", "top_k", "cache_salt"}, exclude_none=True
        )
        if self.stop_sequences is not None:
            sent["stop"] = self.stop_sequences
        return sent


def _block_text(block: _Block, where: str) -> str:
    if block.type != "text" or block.text is None:
        raise SpecError(
            f"{where} is a {clip(block.type)!r} block; the simulator serves text blocks only: "
            "send text",
            field=where.split("[", 1)[0],
        )
    return block.text


def _system_text(system: str | list[_Block] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    parts = []
    for index, block in enumerate(system):
        text = _block_text(block, f"system[{index}]")
        if text and not text.startswith(_BILLING_HEADER):
            parts.append(text)
    return "".join(parts)


def chat_messages(request: _RequestBase) -> list[dict[str, Any]]:
    """The chat messages vLLM renders an Anthropic request from."""
    out: list[dict[str, Any]] = []
    system = _system_text(request.system)
    if system:
        out.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        if isinstance(message.content, str):
            text = message.content
            if message.role == "system" and text.startswith(_BILLING_HEADER):
                continue
            out.append({"role": message.role, "content": text})
            continue
        texts = [
            text
            for j, block in enumerate(message.content)
            if (text := _block_text(block, f"messages[{index}].content[{j}]"))
            and not (message.role == "system" and text.startswith(_BILLING_HEADER))
        ]
        if message.role == "system":
            if texts:
                out.append({"role": "system", "content": "".join(texts)})
        elif len(texts) == 1:
            out.append({"role": message.role, "content": texts[0]})
        elif texts:
            out.append(
                {"role": message.role, "content": [{"type": "text", "text": t} for t in texts]}
            )
        elif message.role == "assistant":
            out.append({"role": "assistant"})  # vLLM keeps an empty assistant turn
    return out


def chat_tools(request: _RequestBase) -> list[dict[str, Any]] | None:
    if request.tools is None:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": {"type": "object", **tool.input_schema},
            },
        }
        for tool in request.tools
    ]


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason_of(
    finish_reason: str, stop_reason: str | int | None
) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) for the engine's finish and stop reasons."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def message_usage(
    num_prompt: int, num_output: int, num_cached: int, num_cache_write: int
) -> dict[str, int]:
    return {
        "input_tokens": max(0, num_prompt - num_cached - num_cache_write),
        "output_tokens": num_output,
        "cache_read_input_tokens": num_cached,
        "cache_creation_input_tokens": num_cache_write,
    }


def message_object(
    message_id: str,
    *,
    model: str,
    text: str,
    stop_reason: StopReason,
    stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        # Anthropic's shape for an empty answer is one empty text block, not [] (vLLM's too).
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def _event(payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()


class MessageEvents:
    """One message stream's SSE events."""

    __slots__ = ("_started",)

    def __init__(self) -> None:
        self._started = False

    @staticmethod
    def start(message_id: str, model: str, num_prompt: int) -> bytes:
        # The cache split is not known yet (vLLM's first chunk has no prompt details).
        message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": num_prompt, "output_tokens": 0},
        }
        return _event({"type": "message_start", "message": message})

    def text(self, deltas: Sequence[str]) -> bytes:
        """content_block_delta per non-empty delta, opened by content_block_start once."""
        parts: list[bytes] = []
        for delta in deltas:
            if not delta:
                continue
            if not self._started:
                self._started = True
                parts.append(
                    _event(
                        {
                            "type": "content_block_start",
                            "index": 0,
                            "content_block": {"type": "text", "text": ""},
                        }
                    )
                )
            parts.append(
                _event(
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": delta},
                    }
                )
            )
        return b"".join(parts)

    def finish(
        self, stop_reason: StopReason, stop_sequence: str | None, usage: dict[str, int]
    ) -> bytes:
        closing = _event({"type": "content_block_stop", "index": 0}) if self._started else b""
        return (
            closing
            + _event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": usage,
                }
            )
            + _event({"type": "message_stop"})
        )

    @staticmethod
    def error(message: str) -> bytes:
        """vLLM's mid-stream error event (serving.py message_stream_converter)."""
        return _event({"type": "error", "error": {"type": "api_error", "message": message}})
