"""The request fields the gateway acts on, read as the engines read them, and written back so.

The gateway reserves tokens from ``max_tokens``, ``max_completion_tokens``, ``n`` and
``best_of``, relays a stream or a whole answer by ``stream``, and tokenizes a chat (locally,
verified against a replica's /tokenize) by ``add_generation_prompt``,
``continue_final_message`` and ``add_special_tokens``. vLLM (and the simulator) read these
with pydantic's lax rules: ``"250"`` and ``250.0`` are the int 250, ``"no"`` is False. Python
read them otherwise: ``"250"`` was not an int, so a completion reserved the default 16 tokens
while the engine generated 250 (1,016 tokens in a minute past a 300-per-minute limit), and
``"no"`` was truthy, so the local render added a generation prompt the engine did not and the
verification, seeing a mismatch, turned local tokenizing off for the model, for every tenant.

So each such field is parsed here by pydantic's own lax rules (the engines' rules, not a
copy of them) and the value is written back into the body in its canonical JSON type before
anything reads it. The engine then receives exactly the value the gateway reserved for and
tokenized with: where the gateway's pydantic and an engine's might disagree on an exotic
spelling, the engine never sees that spelling. A value no rule reads as the field's type, or
outside the range every engine refuses anyway (a negative ``max_tokens``, ``n`` below 1), is a
400 naming the field and what to send.

What it must NOT do: echo the client's value (a message names the field and the value's JSON
type, never its text), or touch a field the gateway does not read (the engine alone judges
those, so the two cannot disagree on them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import TypeAdapter, ValidationError

from llmgw.errors import clip
from llmgw.gateway.apis.chat_parts import json_type
from llmgw.gateway.errors import GatewayError, bad_request

__all__ = ["canonicalize"]

_INT: Final = TypeAdapter(int)
_BOOL: Final = TypeAdapter(bool)


@dataclass(frozen=True, slots=True)
class _Field:
    kind: Literal["int", "bool"]
    nullable: bool  # vLLM's Optional[...]: an explicit null is the field's default there
    least: int | None = None  # ints: the smallest value any engine accepts


# vLLM's types (vllm/entrypoints/openai/protocol.py: ChatCompletionRequest, CompletionRequest).
# `max_completion_tokens` on completions is not OpenAI's, but vLLM's get_max_tokens reads it
# from either request (`getattr(request, "max_completion_tokens", None) or max_tokens`, the
# extra field kept as sent), so it is parsed and reserved for there too.
_COMMON: Final = {
    "max_tokens": _Field("int", nullable=True, least=0),
    "max_completion_tokens": _Field("int", nullable=True, least=0),
    "best_of": _Field("int", nullable=True, least=1),
    "stream": _Field("bool", nullable=True),
}
_CHAT: Final = {
    **_COMMON,
    "n": _Field("int", nullable=True, least=1),
    "echo": _Field("bool", nullable=False),
    "add_generation_prompt": _Field("bool", nullable=False),
    "continue_final_message": _Field("bool", nullable=False),
    "add_special_tokens": _Field("bool", nullable=False),
}
_COMPLETIONS: Final = {
    **_COMMON,
    "n": _Field("int", nullable=False, least=1),
    "echo": _Field("bool", nullable=True),
    "add_special_tokens": _Field("bool", nullable=False),
}
_STREAM_OPTIONS: Final = {
    "include_usage": _Field("bool", nullable=True),
    "continuous_usage_stats": _Field("bool", nullable=True),
}


def canonicalize(body: dict[str, Any], *, chat: bool) -> None:
    """Rewrite, in ``body``, each field the gateway reads to the value the engine reads it as;
    a ``GatewayError`` (400) for a value that is none."""
    fields = _CHAT if chat else _COMPLETIONS
    for name, field in fields.items():
        if name in body:
            body[name] = _parse(name, body[name], field)
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise bad_request(
            f'`stream_options` must be an object such as {{"include_usage": true}}; got '
            f"{json_type(options)}",
            param="stream_options",
        )
    for name, field in _STREAM_OPTIONS.items():
        if name in options:
            options[name] = _parse(f"stream_options.{name}", options[name], field)


def _parse(name: str, value: object, field: _Field) -> object:
    # The canonical types pass without pydantic: the common case costs a type check.
    if value is None:
        if field.nullable:
            return None
        raise _refused(name, value, field)
    if field.kind == "bool":
        if type(value) is bool:
            return value
        try:
            return _BOOL.validate_python(value)
        except ValidationError:
            raise _refused(name, value, field) from None
    try:
        number = value if type(value) is int else _INT.validate_python(value)
    except ValidationError:
        raise _refused(name, value, field) from None
    if field.least is not None and number < field.least:
        raise bad_request(
            f"`{name}` must be at least {field.least}; got {clip(str(number))}", param=name
        )
    return number


def _refused(name: str, value: object, field: _Field) -> GatewayError:
    if field.kind == "bool":
        want = (
            "true or false (or a string the engine reads as one: "
            '"true"/"false", "yes"/"no", "on"/"off", "1"/"0")'
        )
    else:
        want = "a whole number such as 256 (a float or string must hold a whole number)"
    if not field.nullable:
        want += ", not null"
    return bad_request(f"`{name}` must be {want}; got {json_type(value)}", param=name)
