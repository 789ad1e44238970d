"""What the conversions of other families to chat share: the chat request they make, the
refusal of a body the engine would refuse, and the pieces both write as vLLM writes them (a
function tool, the template's keyword arguments).

What it must NOT do: echo a client's value (``json_type`` names a value's JSON type instead).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from llmgw.errors import SpecError

__all__ = ["ChatRequest", "Refused", "function_tool", "json_type", "template_kwargs"]


class Refused(SpecError):
    """A body the engine would refuse (or fail on); ``field`` names the field. The public
    listener answers it 400 in the family's error shape."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A body of another family as the chat request the engine renders it as.

    ``body["messages"]`` may be empty: a Responses follow-up that adds no input, or an empty
    conversation, which the engine renders too (its template's generation prompt alone).
    ``wire.prompt_of`` refuses an empty chat, so the shell routes such a request without a
    prompt: by its stored response's replica, else by load."""

    body: dict[str, Any]  # a chat-completions body without `model`: what the chat path reads
    # The engine prepends a stored conversation the gateway cannot see (previous_response_id):
    # `body` is only the new turn, so the request is routed by the id, not by this prompt.
    stored_history: bool = False


def function_tool(tool: Mapping[str, Any], where: str, name: object) -> dict[str, Any]:
    """A function tool as vLLM's ``ChatCompletionToolsParam(...).model_dump()`` writes it:
    name, description and parameters always (null when not given), strict and defer_loading
    only when set."""
    if not isinstance(name, str) or not name:
        raise Refused(f"{where}.name must be a non-empty string", field=f"{where}.name")
    description, parameters = tool.get("description"), tool.get("parameters")
    if description is not None and not isinstance(description, str):
        raise Refused(f"{where}.description must be a string", field=f"{where}.description")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise Refused(
            f"{where}.parameters must be a JSON schema object", field=f"{where}.parameters"
        )
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    for flag in ("strict", "defer_loading"):
        value = tool.get(flag)
        if value is not None:
            if not isinstance(value, bool):
                raise Refused(
                    f"{where}.{flag} must be true, false or null", field=f"{where}.{flag}"
                )
            function[flag] = value
    return {"type": "function", "function": function}


_REQUEST_KWARGS: Final = ("add_generation_prompt", "continue_final_message")


def template_kwargs(raw: object, effort: str | None) -> dict[str, Any]:
    """The template's keyword arguments as ``build_chat_params`` merges them: the client's,
    then the reasoning effort (and ``enable_thinking`` unless the client set it) over them.
    Folded into ``chat_template_kwargs``, the one field the chat path's render and /tokenize
    both pass to the template."""
    if raw is not None and not isinstance(raw, Mapping):
        raise Refused(
            f"`chat_template_kwargs` must be an object; got {json_type(raw)}",
            field="chat_template_kwargs",
        )
    # The request's own add_generation_prompt and continue_final_message override the
    # client's kwargs of those names there; the chat body carries them as fields.
    kwargs = {k: v for k, v in (raw or {}).items() if k not in _REQUEST_KWARGS}
    if effort is not None and effort != "auto":
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        kwargs["reasoning_effort"] = effort
    return kwargs


def json_type(value: object) -> str:
    """The value's JSON type, in words: a client's value is never echoed."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__
