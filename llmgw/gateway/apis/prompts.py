"""What a body of each new family amounts to, for routing and for the key's limits: a Responses
or an Anthropic Messages body as the chat request the engine turns it into, and the output
tokens each family asks to reserve.

The engine (vLLM 0.32) serves both families by converting them to chat and rendering that with
the model's chat template, so the prompt the KV cache holds is the chat's. The gateway routes
by that prompt: ``responses_chat`` and ``messages_chat`` return a chat-completions body
(``messages``, ``tools``, ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``) that the chat path's prompt reader, local renderer and a replica's
/tokenize then treat as any chat. Each follows the engine's own conversion, read from the
installed build step by step (``responses_input`` and ``messages_input`` name the files).

Content parts the chat parser reads as text (``input_text``, ``output_text``, ``refusal``;
``vllm/renderers/chat_utils.py``: ``TEXT_PART_TYPES``) become ``{"type": "text"}`` parts, so
the chat path sees what the template will; any other part (an image, a file) is kept as sent,
which the chat path counts as multimodal.

Where the engine's render depends on what the gateway cannot see, the chat body is the best
the gateway knows, and routing pays for the difference, never correctness (the engine renders
its own): a follow-up's stored conversation (``previous_response_id``: the engine prepends it;
``ChatRequest.stored_history`` says so, and such a request goes to the replica holding it
anyway), whether the model's template wants inline system messages merged (the shell passes
``merge_inline_system``, vLLM's probe of the template), the effort a model that cannot disable
thinking is given (``disabled_thinking_effort``), a tool call's id made from the clock when a
``tool_use`` block has none.

Bounded: a body whose shape the engine refuses (or on which its conversion would fail with a
500) is refused here, a ``Refused`` whose ``field`` names the field (OpenAI's ``param``) and
whose message names the fix; the shell answers it 400 (``errors.bad_request(exc.message,
param=exc.field)``). Every value read is type-checked before use; the body's size and depth
were bounded by the listener before anything here runs.

What it must NOT do: mutate the client's body (outside ``canonicalize``, whose job it is),
echo a client's value (a message names fields and JSON types), or decide where a request goes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import TypeAdapter, ValidationError

from llmgw.gateway.apis.chat_parts import ChatRequest, Refused, json_type
from llmgw.gateway.apis.families import ApiName
from llmgw.gateway.apis.messages_input import messages_chat
from llmgw.gateway.apis.responses_input import responses_chat

__all__ = [
    "ChatRequest",
    "Refused",
    "canonicalize",
    "messages_chat",
    "reserve",
    "responses_chat",
]


# --- the fields the gateway acts on, read as the engine reads them --------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    kind: Literal["int", "bool"]
    required: bool  # a body without it is refused (Anthropic's max_tokens)
    nullable: bool  # an explicit null is the field's default
    least: int | None = None  # ints: the smallest the engine serves


_INT: Final = TypeAdapter(int)
_BOOL: Final = TypeAdapter(bool)
# vLLM's types: ResponsesRequest (responses/protocol.py: `max_output_tokens: int | None`, a
# value under 1 fails its sampling parameters), AnthropicMessagesRequest (`max_tokens: int`,
# required, "max_tokens must be positive"; `stream: bool | None`).
_FIELDS: Final[Mapping[str, Mapping[str, _Field]]] = {
    "responses": {
        "max_output_tokens": _Field("int", required=False, nullable=True, least=1),
        "stream": _Field("bool", required=False, nullable=True),
    },
    "messages": {
        "max_tokens": _Field("int", required=True, nullable=False, least=1),
        "stream": _Field("bool", required=False, nullable=True),
    },
}


def canonicalize(api: ApiName, body: dict[str, Any]) -> None:
    """Rewrite, in ``body``, each field the gateway reads (output limits, ``stream``) to the
    value the engine reads it as (pydantic's lax rules, the engine's: ``"250"`` is 250,
    ``"no"`` is False), so the engine receives exactly what the gateway reserved for; a
    ``Refused`` for a value no rule reads as its type, one out of range, or a required field
    missing. Chat and completions have theirs in ``llmgw.gateway.engine_fields``."""
    for name, field in _FIELDS.get(api, {}).items():
        if name in body:
            body[name] = _parse(name, body[name], field)
        elif field.required:
            raise Refused(
                f"`{name}` is required: the most tokens to generate, such as 1024 "
                "(Anthropic's API requires it on every request)",
                field=name,
            )


def _parse(name: str, value: object, field: _Field) -> object:
    if value is None:
        if field.nullable:
            return None
        raise _wrong_type(name, value, field)
    try:
        if field.kind == "bool":
            return value if type(value) is bool else _BOOL.validate_python(value)
        number = value if type(value) is int else _INT.validate_python(value)
    except ValidationError:
        raise _wrong_type(name, value, field) from None
    if field.least is not None and number < field.least:
        raise Refused(f"`{name}` must be at least {field.least}; got {number}", field=name)
    return number


def _wrong_type(name: str, value: object, field: _Field) -> Refused:
    want = "true or false" if field.kind == "bool" else "a whole number such as 1024"
    if not field.nullable:
        want += ", not null"
    return Refused(f"`{name}` must be {want}; got {json_type(value)}", field=name)


def reserve(api: ApiName, body: Mapping[str, Any]) -> int | None:
    """The output tokens a request of ``api`` may generate, to reserve from the key's limits,
    read from a canonical body (``canonicalize``): Responses' ``max_output_tokens`` (None when
    not sent: the engine's default is the model's context less the prompt, which the shell
    knows, as for chat), Messages' ``max_tokens``; 0 for a family that generates nothing
    (counting, pooling). Chat and completions: ``llmgw.gateway.wire.reserve_tokens``."""
    if api == "responses":
        value = body.get("max_output_tokens")
        return value if type(value) is int else None
    if api == "messages":
        value = body.get("max_tokens")
        if type(value) is not int:
            raise Refused("`max_tokens` is required: call canonicalize first", field="max_tokens")
        return value
    if api in ("count_tokens", "embeddings", "rerank", "score"):
        return 0
    raise ValueError(f"reserve has no rule for {api!r}: chat and completions are wire's")
