"""OpenAI's Responses API in the simulator: the request, its chat messages, stored responses,
the response object and its stream events.

Shapes and rules follow vLLM 0.32's Responses server (vllm/entrypoints/openai/responses/):
protocol.py's `ResponsesResponse` and `ResponseUsage` (the body and its usage, vLLM's extra
usage fields included), serving.py's store (a follow-up or a GET finds only what this process
stored; an unknown id is a 404 "Response with id '...' not found."; only a response still
queued or in progress can be cancelled, anything else is the 400 "Cannot cancel a synchronous
response."), utils.py's `construct_input_messages` (how instructions, the stored history and
the new input become chat messages) and streaming_events.py's text events. vLLM stores only
with VLLM_ENABLE_RESPONSES_API_STORE=1; the simulator behaves as an engine started with it.

The store is bounded (entries and characters, least recently used first out): vLLM's grows
without limit, but the simulator runs in every test and a chain of long conversations must
not be what exhausts its memory.

Must NOT touch the engine or sockets (api_routes.py does), nor tokenize.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmgw.errors import NotFoundError, SpecError, clip

__all__ = [
    "DEFAULT_STORE_MAX_CHARS",
    "DEFAULT_STORE_MAX_ENTRIES",
    "ResponseEvents",
    "ResponseStatus",
    "ResponseStore",
    "ResponsesRequest",
    "StoredResponse",
    "cancel_refusal",
    "chat_tools",
    "input_messages",
    "message_item",
    "new_item_id",
    "new_response_id",
    "not_found",
    "response_object",
    "response_usage",
    "sampling_fields",
]

ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]

DEFAULT_STORE_MAX_ENTRIES: Final = 4096
# Characters of stored conversation text: a follow-up stores its whole history again, so a
# 20-turn chain of 100 KB turns holds ~20 MB; 64 Mi characters keeps a few such chains.
DEFAULT_STORE_MAX_CHARS: Final = 64 * 1024 * 1024
# What a stored entry costs beside its text (ids, the body's fixed fields), so that many
# tiny responses count against the budget too.
_ENTRY_OVERHEAD_CHARS: Final = 1024

# The sampling fields a Responses request shares with chat completions: forwarded unchanged
# into the chat request the simulator generates from, so they are validated (and named in
# errors) exactly as chat's are.
_SAMPLING_FIELDS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "cache_salt",
)
# vLLM's defaults when the request leaves them out (protocol.py _DEFAULT_SAMPLING_PARAMS),
# reported in the response object.
_DEFAULT_TEMPERATURE: Final = 1.0
_DEFAULT_TOP_P: Final = 1.0
# Input item content part types that carry text (vLLM's chat parser reads all three as text).
_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text"})


class ResponsesRequest(BaseModel):
    """The fields the simulator reads; others are accepted and ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = True
    truncation: Literal["auto", "disabled"] | None = "disabled"
    service_tier: str | None = "auto"
    user: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Reported in the response object; validated with the other sampling fields (below).
    temperature: float | None = None
    top_p: float | None = None

    def check(self) -> None:
        if self.background and not self.store:
            raise SpecError(
                "background=true needs store=true: a background response is fetched later "
                "with GET /v1/responses/{id}; send store=true or drop background",
                field="background",
            )
        if self.background and self.stream:
            raise SpecError(
                "background=true with stream=true is not supported by the simulator; send "
                "one of them",
                field="background",
            )


def sampling_fields(request: ResponsesRequest) -> dict[str, Any]:
    """The request's sampling fields that were sent, as chat completions names them."""
    sent = request.model_dump(include={"temperature", "top_p"}, exclude_none=True)
    extra = request.model_extra or {}
    sent.update((name, extra[name]) for name in _SAMPLING_FIELDS if name in extra)
    return sent


@dataclass(slots=True)
class StoredResponse:
    """One response this process made, kept for GET, cancel and `previous_response_id`."""

    # The response object as it was (or will next be) answered; updated when a background
    # response finishes or is cancelled.
    body: dict[str, Any]
    # The chat messages the request was rendered from (its instructions included): a
    # follow-up's history, as vLLM's msg_store keeps them.
    messages: tuple[dict[str, Any], ...]
    num_chars: int


class ResponseStore:
    """Stored responses, least recently used evicted first once over either bound.

    Called from the event loop only (the HTTP shell's thread hops never touch it).
    """

    def __init__(
        self,
        *,
        max_entries: int = DEFAULT_STORE_MAX_ENTRIES,
        max_chars: int = DEFAULT_STORE_MAX_CHARS,
    ) -> None:
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(
        self, response_id: str, body: dict[str, Any], messages: Sequence[dict[str, Any]]
    ) -> None:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self._num_chars -= old.num_chars
        size = _ENTRY_OVERHEAD_CHARS + _messages_chars(messages) + _output_chars(body)
        self._entries[response_id] = StoredResponse(body, tuple(messages), size)
        self._num_chars += size
        # The newest entry stays even when it alone is over the budget: a follow-up to the
        # response just answered must find it.
        while len(self._entries) > 1 and (
            len(self._entries) > self._max_entries or self._num_chars > self._max_chars
        ):
            _, evicted = self._entries.popitem(last=False)
            self._num_chars -= evicted.num_chars

    def update_body(self, response_id: str, body: dict[str, Any]) -> bool:
        """Replace a stored response's body (a background response finished); False when it
        was evicted meanwhile."""
        entry = self._entries.get(response_id)
        if entry is None:
            return False
        self.put(response_id, body, entry.messages)
        return True


def _text_of(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _messages_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(_text_of(p.get("text"))) for p in content if isinstance(p, Mapping))
    return total


def _output_chars(body: Mapping[str, Any]) -> int:
    return sum(len(text) for text in _output_texts(body))


def _output_texts(body: Mapping[str, Any]) -> list[str]:
    texts: list[str] = []
    for item in body.get("output") or ():
        if item.get("type") == "message":
            texts.extend(_text_of(part.get("text")) for part in item.get("content") or ())
    return texts


def not_found(response_id: str) -> NotFoundError:
    """vLLM's wording (serving.py _make_not_found_error), then why and what to do."""
    return NotFoundError(
        f"Response with id '{clip(response_id)}' not found. Responses are stored only by the "
        "engine process that created them, while it runs and until its store evicts them; "
        "send the request to that engine, or resend the conversation as input",
        field="response_id",
    )


def cancel_refusal(status: str) -> SpecError:
    """vLLM's wording (serving.py cancel_responses), then why."""
    return SpecError(
        f"Cannot cancel a synchronous response. This one is {status}: only a background "
        "response that is still queued or in progress can be cancelled",
        field="response_id",
    )


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_item_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def chat_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """The request's function tools as chat completions declares them: what the chat template
    renders. Other tool types (web search, file search...) are not rendered, as vLLM renders
    only function tools without a tool server (utils.py construct_tool_dicts)."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        if tool.get("type") != "function":
            continue
        function = {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool
        }
        out.append({"type": "function", "function": function})
    return out or None


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat completions takes it: a string, or text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise SpecError(
                    f"{where}.content[{index}] is a part of type {clip(str(kind))!r}; the "
                    "simulator serves text only: send input_text parts",
                    field="input",
                )
            parts.append({"type": "text", "text": part["text"]})
        return parts
    raise SpecError(
        f"{where}.content is a {type(content).__name__}; send a string or a list of "
        "input_text parts",
        field="input",
    )


def _item_message(item: Mapping[str, Any], index: int) -> dict[str, Any]:
    where = f"input[{index}]"
    role = item.get("role")
    kind = item.get("type", "message")
    if kind != "message" or not isinstance(role, str) or not role:
        raise SpecError(
            f"{where} is an item of type {clip(str(kind))!r}; the simulator serves message "
            "items (a role and text content) only: send those, or a string input",
            field="input",
        )
    content = _content(item.get("content"), where)
    if role == "assistant" and isinstance(content, list):
        # vLLM keeps the first part of an assistant item (utils.py
        # _construct_message_from_response_item); its later parts never reach the template.
        return {"role": role, "content": content[0]["text"] if content else ""}
    return {"role": role, "content": content}


def input_messages(
    request: ResponsesRequest, previous: StoredResponse | None
) -> list[dict[str, Any]]:
    """The chat messages a request is rendered from, as vLLM builds them: this request's
    instructions as the system message (instructions never carry over), the previous
    request's messages without their system message, the previous output as assistant
    messages, then the new input. Turn N's prompt is therefore turn N-1's prompt and output
    followed by the new input, and the prefix cache serves the history."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if previous is not None:
        messages.extend(m for m in previous.messages if m.get("role") != "system")
        messages.extend({"role": "assistant", "content": t} for t in _output_texts(previous.body))
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        messages.extend(_item_message(item, i) for i, item in enumerate(request.input))
    return messages


def message_item(
    item_id: str, text: str, status: Literal["in_progress", "completed"]
) -> dict[str, Any]:
    """An assistant output message; an empty text has no content part (vLLM's fallback)."""
    parts = [_output_text(text)] if text else []
    return {
        "id": item_id,
        "content": parts,
        "role": "assistant",
        "status": status,
        "type": "message",
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def response_usage(
    num_prompt: int, num_output: int, num_cached: int, num_cache_write: int
) -> dict[str, Any]:
    """vLLM's ResponseUsage for a single-turn request (its per-turn lists stay empty there)."""
    return {
        "input_tokens": num_prompt,
        "input_tokens_details": {
            "cached_tokens": num_cached,
            "cache_write_tokens": num_cache_write,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": num_output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": num_prompt + num_output,
    }


def response_object(
    request: ResponsesRequest,
    *,
    response_id: str,
    created_at: int,
    model: str,
    status: ResponseStatus,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    max_output_tokens: int | None,
) -> dict[str, Any]:
    """The response object, field for field as vLLM's ResponsesResponse.from_request fills it."""
    return {
        "id": response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "metadata": request.metadata,
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": (
            True if request.parallel_tool_calls is None else request.parallel_tool_calls
        ),
        "temperature": _DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        "tool_choice": request.tool_choice,
        "tools": request.tools,
        "top_p": _DEFAULT_TOP_P if request.top_p is None else request.top_p,
        "background": bool(request.background),
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "previous_response_id": request.previous_response_id,
        "prompt": None,
        "reasoning": request.reasoning,
        "service_tier": request.service_tier or "auto",
        "status": status,
        "text": request.text,
        "top_logprobs": None,
        "truncation": request.truncation or "disabled",
        "usage": usage,
        "user": request.user,
        "presence_penalty": _sent_number(request, "presence_penalty"),
        "frequency_penalty": _sent_number(request, "frequency_penalty"),
    }


def _sent_number(request: ResponsesRequest, name: str) -> Any:
    """A sampling field as vLLM reports it: what was sent, else its default of 0.0."""
    value = (request.model_extra or {}).get(name)
    return 0.0 if value is None else value


class ResponseEvents:
    """One stream's SSE events, numbered from 0 in the order they are written (vLLM's
    `sequence_number`), each as `event: <type>` plus its JSON (api_router.py's framing)."""

    __slots__ = ("_item_id", "_seq")

    def __init__(self) -> None:
        self._seq = 0
        self._item_id = ""

    def _event(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self._seq
        self._seq += 1
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {payload['type']}\ndata: {data}\n\n".encode()

    def opening(self, initial: dict[str, Any]) -> bytes:
        """response.created and response.in_progress, both carrying the in-progress object."""
        return self._event({"type": "response.created", "response": initial}) + self._event(
            {"type": "response.in_progress", "response": initial}
        )

    def text_started(self, item_id: str) -> bytes:
        """Before the first delta: the message item and its output_text part, both empty."""
        self._item_id = item_id
        return self._event(
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": message_item(item_id, "", "in_progress"),
            }
        ) + self._event(
            {
                "type": "response.content_part.added",
                "output_index": 0,
                "item_id": item_id,
                "content_index": 0,
                "part": {**_output_text(""), "logprobs": []},
            }
        )

    def text_delta(self, delta: str) -> bytes:
        return self._event(
            {
                "type": "response.output_text.delta",
                "content_index": 0,
                "output_index": 0,
                "item_id": self._item_id,
                "delta": delta,
                "logprobs": [],
            }
        )

    def text_done(self, text: str) -> bytes:
        """output_text.done, content_part.done and output_item.done, each with the whole text."""
        item_id = self._item_id
        return (
            self._event(
                {
                    "type": "response.output_text.done",
                    "output_index": 0,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                    "item_id": item_id,
                }
            )
            + self._event(
                {
                    "type": "response.content_part.done",
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": _output_text(text),
                }
            )
            + self._event(
                {
                    "type": "response.output_item.done",
                    "output_index": 0,
                    "item": message_item(item_id, text, "completed"),
                }
            )
        )

    def completed(self, response: dict[str, Any]) -> bytes:
        # vLLM ends with response.completed whatever the final status (incomplete included).
        return self._event({"type": "response.completed", "response": response})

    def error(self, message: str, code: str) -> bytes:
        """OpenAI's stream error event: the engine stopped mid-response."""
        return self._event({"type": "error", "code": code, "message": message, "param": None})
