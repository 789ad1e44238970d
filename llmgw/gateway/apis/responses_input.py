"""A Responses body as the chat request vLLM renders it: ``responses_chat`` (re-exported by
``prompts``, which says why and how).

The engine's conversion, followed step by step: ``vllm/entrypoints/openai/responses/utils.py``
(``construct_input_messages``, ``_construct_message_from_response_item``,
``should_continue_final_message``, ``construct_tool_dicts``), ``responses/protocol.py``
(``input_item_parsing``, ``build_chat_params``) and ``vllm/tool_parsers/utils.py``
(``get_function_tools``), in vLLM 0.32's CPU build.

What it must NOT do: mutate the client's body, or echo a client's value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from llmgw.errors import clip
from llmgw.gateway.apis.chat_parts import (
    ChatRequest,
    Refused,
    function_tool,
    json_type,
    template_kwargs,
)

__all__ = ["responses_chat"]


# Part types the chat parser reads as text (vllm/renderers/chat_utils.py: TEXT_PART_TYPES,
# MM_PARSER_MAP), and the key each keeps its text under.
_TEXT_PARTS: Final = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
}
_MESSAGE_ROLES: Final = ("user", "assistant", "system", "developer")
_ITEM_TYPES: Final = (
    "message (an object with role and content), function_call, function_call_output, "
    "reasoning, custom_tool_call or custom_tool_call_output"
)
# vllm/tool_parsers/utils.py: a namespace's functions are shown as "<namespace>__<name>", a
# custom tool as a function taking one string (custom_tool_parameters).
_NAMESPACE_SEPARATOR: Final = "__"
_CUSTOM_TOOL_INPUT_KEY: Final = "input"
_CUSTOM_TOOL_PARAMETERS: Final[Mapping[str, Any]] = {
    "type": "object",
    "properties": {
        _CUSTOM_TOOL_INPUT_KEY: {
            "type": "string",
            "description": "The freeform text payload for this tool.",
        }
    },
    "required": [_CUSTOM_TOOL_INPUT_KEY],
    "additionalProperties": False,
}


def responses_chat(body: Mapping[str, Any]) -> ChatRequest:
    """The chat request a Responses body is rendered as (``construct_input_messages``): the
    ``instructions`` as a system message, then the ``input`` (a string: one user message; a
    list: its items, a tool call merged into the assistant message before it as the engine
    merges it), the function tools, and the template's options (``build_chat_params``)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise Refused(
            f"`instructions` must be a string (the system prompt) or null; got "
            f"{json_type(instructions)}",
            field="instructions",
        )
    if instructions:
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    continue_final = False
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list):
        for i, item in enumerate(raw):
            _response_item(item, i, messages)
        continue_final = _continues_final(raw)
    else:
        raise Refused(
            "`input` is required: a string, or a list of input items such as "
            '[{"role": "user", "content": "Hello"}]; got ' + json_type(raw),
            field="input",
        )
    previous = body.get("previous_response_id")
    chat: dict[str, Any] = {"messages": messages}
    tools = _response_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if continue_final:
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    effort = None
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and isinstance(reasoning.get("effort"), str):
        effort = reasoning["effort"]
    kwargs = template_kwargs(body.get("chat_template_kwargs"), effort)
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return ChatRequest(chat, stored_history=previous is not None)


def _response_item(item: object, i: int, messages: list[dict[str, Any]]) -> None:
    """One input item appended to ``messages``, or merged into the assistant message before
    it (``_construct_message_from_response_item``)."""
    where = f"input[{i}]"
    if not isinstance(item, Mapping):
        raise Refused(
            f"{where} must be an object: {_ITEM_TYPES}; got {json_type(item)}", field=where
        )
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item, where, custom=kind == "custom_tool_call")
        if prev is None:
            messages.append({"role": "assistant", "tool_calls": [call]})
        elif prev.get("tool_calls") is None:
            prev["tool_calls"] = [call]
        else:
            prev["tool_calls"].append(call)  # a list: every assistant here is built below
        return
    if kind == "reasoning":
        text = _reasoning_text(item, where)
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            messages.append({"role": "assistant", "reasoning": text})
        return
    if kind in ("function_call_output", "custom_tool_call_output"):
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise Refused(
                f"{where}.call_id must be the string id of the call it answers",
                field=f"{where}.call_id",
            )
        messages.append(
            {
                "role": "tool",
                "content": _tool_output(item.get("output"), where),
                "tool_call_id": call_id,
            }
        )
        return
    role = item.get("role")
    if kind not in (None, "message") or role is None:
        what = "no type and no role" if kind is None else f"type {clip(str(kind))!r}"
        raise Refused(f"{where} has {what}; the engine takes {_ITEM_TYPES}", field=where)
    if role not in _MESSAGE_ROLES:
        raise Refused(
            f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}", field=f"{where}.role"
        )
    content = item.get("content")
    if role == "assistant":
        # The engine keeps an assistant message's first part only (content[0].text).
        text = _assistant_text(content, where)
        if prev is not None and prev.get("content") is None:
            prev["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
        return
    messages.append({"role": role, "content": _input_content(content, f"{where}.content")})


def _continues_final(items: list[Any]) -> bool:
    """``should_continue_final_message``: a last message or reasoning item still in progress
    is continued (Anthropic-style prefill) instead of answered."""
    last = items[-1] if items else None
    if not isinstance(last, Mapping):
        return False
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in ("in_progress", "incomplete")


def _tool_call(item: Mapping[str, Any], where: str, *, custom: bool) -> dict[str, Any]:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise Refused(f"{where} must have a string `call_id` and `name`", field=where)
    if custom:
        payload = item.get("input")
        if payload is not None and not isinstance(payload, str):
            raise Refused(f"{where}.input must be a string", field=f"{where}.input")
        arguments = json.dumps({_CUSTOM_TOOL_INPUT_KEY: payload or ""}, ensure_ascii=False)
    else:
        given = item.get("arguments")
        if not isinstance(given, str):
            raise Refused(f"{where}.arguments must be a string of JSON", field=f"{where}.arguments")
        arguments = given
        namespace = item.get("namespace")
        if isinstance(namespace, str) and namespace:
            name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    if item.get("encrypted_content"):
        raise Refused(
            f"{where}.encrypted_content is not supported by the engine: send the reasoning "
            "as `content` or `summary` text, or leave the item out",
            field=f"{where}.encrypted_content",
        )
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise Refused(f"{where}.{key} must be a list of text parts", field=f"{where}.{key}")
        if parts:
            first = parts[0]
            text = first.get("text") if isinstance(first, Mapping) else None
            if not isinstance(text, str):
                raise Refused(
                    f"{where}.{key}[0] must be an object with a string `text`",
                    field=f"{where}.{key}",
                )
            return text
    return ""


def _assistant_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        first = content[0]
        text = first.get("text") if isinstance(first, Mapping) else None
        if isinstance(text, str):
            return text
    # An empty list or a refusal first: the engine's conversion fails on it (a 500).
    raise Refused(
        f"{where}.content of an assistant message must be a string or a list whose first part "
        'is {"type": "output_text", "text": ...}',
        field=f"{where}.content",
    )


def _input_content(content: object, where: str) -> str | list[dict[str, Any]]:
    """A message's content with text parts as the chat parser reads them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Refused(
            f"{where} must be a string or a list of content parts such as "
            f'{{"type": "input_text", "text": "..."}}; got {json_type(content)}',
            field=where,
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if not isinstance(kind, str):
            raise Refused(
                f"{where}[{j}] must be an object with a string `type`", field=f"{where}[{j}]"
            )
        assert isinstance(part, Mapping)
        key = _TEXT_PARTS.get(kind)
        if key is None:
            parts.append(dict(part))  # an image, a file: the chat path counts it multimodal
            continue
        text = part.get(key)
        if not isinstance(text, str):
            raise Refused(f"{where}[{j}].{key} must be a string", field=f"{where}[{j}].{key}")
        parts.append({"type": "text", "text": text})
    return parts


def _tool_output(output: object, where: str) -> str | list[dict[str, Any]] | None:
    if output is None or isinstance(output, str):
        return output
    return _input_content(output, f"{where}.output")


def _response_tools(raw: object) -> list[dict[str, Any]]:
    """The function tools the template is shown (``construct_tool_dicts`` over
    ``get_function_tools``), in the chat tools' shape as the engine dumps them. Tools the
    model is never shown (web search, file search, MCP, ...) are dropped, as there."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise Refused(f"`tools` must be a list of tools; got {json_type(raw)}", field="tools")
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise Refused(f"{where} must be an object", field=where)
        kind = tool.get("type")
        if kind == "function":
            tools.append(function_tool(tool, where, tool.get("name")))
        elif kind == "custom":
            shim = {
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": _CUSTOM_TOOL_PARAMETERS,
            }
            tools.append(function_tool(shim, where, shim["name"]))
        elif kind == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(inner, list):
                raise Refused(
                    f"{where} (a namespace) must have a string `name` and a list of `tools`",
                    field=where,
                )
            for j, sub in enumerate(inner):
                if isinstance(sub, Mapping) and sub.get("type") == "function":
                    name = sub.get("name")
                    if isinstance(name, str):  # else refused by function_tool, naming it
                        name = f"{namespace}{_NAMESPACE_SEPARATOR}{name}"
                    tools.append(function_tool(sub, f"{where}.tools[{j}]", name))
    return tools
