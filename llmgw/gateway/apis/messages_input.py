"""An Anthropic Messages (or count_tokens) body as the chat request vLLM renders it:
``messages_chat`` (re-exported by ``prompts``, which says why and how).

The engine's conversion, followed step by step: ``vllm/entrypoints/anthropic/serving.py``
(``to_chat_completion_request`` and the converters it calls) and ``anthropic/protocol.py``
(the request's validators), in vLLM 0.32's CPU build.

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

__all__ = ["messages_chat"]


_BLOCK_TYPES: Final = frozenset(
    {
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    }
)
_TOOL_CHANGES: Final = ("tool_addition", "tool_removal")
_ANTHROPIC_ROLES: Final = ("user", "assistant", "system")
# Claude Code's attribution header carries a per-request hash; the engine drops it so the
# system prompt stays a cacheable prefix (`_convert_system_message`).
_BILLING_HEADER: Final = "x-anthropic-billing-header"


def messages_chat(
    body: Mapping[str, Any],
    *,
    merge_inline_system: bool = False,
    disabled_thinking_effort: str = "none",
) -> ChatRequest:
    """The chat request an Anthropic Messages (or count_tokens) body is rendered as
    (``to_chat_completion_request``). ``merge_inline_system``: the model's template refuses
    a system message after the first (vLLM probes it with [system, user, system, user]), so
    the engine merges every system message into the leading one. ``disabled_thinking_effort``:
    the effort ``thinking: {"type": "disabled"}`` becomes ("none", or "low" for a model whose
    template ignores "none": vLLM's probe)."""
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise Refused(
            '`messages` must be a list of messages such as [{"role": "user", "content": '
            f'"Hello"}}]; got {json_type(raw)}',
            field="messages",
        )
    checked = [_anthropic_message(m, i) for i, m in enumerate(raw)]
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"), "system", top=True)
    parts = [system] if system else []
    if merge_inline_system:
        parts.extend(
            t for role, content in checked if role == "system" and (t := _inline_system(content))
        )
    if parts:
        messages.append({"role": "system", "content": "".join(parts)})
    for i, (role, content) in enumerate(checked):
        if role == "system":
            if not merge_inline_system and (text := _inline_system(content)):
                messages.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        else:
            _convert_blocks(content, role, converted, messages, f"messages[{i}].content")
        if not (role == "user" and "content" not in converted):
            messages.append(converted)
    chat: dict[str, Any] = {"messages": messages}
    tools = _anthropic_tools(body, checked)
    if tools:
        chat["tools"] = tools
    kwargs = template_kwargs(
        body.get("chat_template_kwargs"), _anthropic_effort(body, disabled_thinking_effort)
    )
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return ChatRequest(chat)


def _anthropic_message(raw: object, i: int) -> tuple[str, str | list[Mapping[str, Any]]]:
    where = f"messages[{i}]"
    if not isinstance(raw, Mapping):
        raise Refused(f"{where} must be an object with `role` and `content`", field=where)
    role = raw.get("role")
    if role not in _ANTHROPIC_ROLES:
        raise Refused(
            f"{where}.role must be one of {', '.join(_ANTHROPIC_ROLES)}", field=f"{where}.role"
        )
    content = raw.get("content")
    if isinstance(content, str):
        return role, content
    blocks = _blocks(content, f"{where}.content")
    if role != "system":
        for j, block in enumerate(blocks):
            if block["type"] in _TOOL_CHANGES:
                raise Refused(
                    f"{where}.content[{j}]: {block['type']} blocks are only allowed "
                    'in messages with role "system"',
                    field=f"{where}.content",
                )
    return role, blocks


def _blocks(content: object, where: str) -> list[Mapping[str, Any]]:
    if not isinstance(content, list):
        raise Refused(
            f'{where} must be a string or a list of content blocks such as {{"type": "text", '
            f'"text": "..."}}; got {json_type(content)}',
            field=where,
        )
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if not isinstance(kind, str) or kind not in _BLOCK_TYPES:
            raise Refused(
                f"{where}[{j}] must be a content block of type {', '.join(sorted(_BLOCK_TYPES))}",
                field=f"{where}[{j}]",
            )
        assert isinstance(block, Mapping)
        for key in ("text", "thinking", "id", "name", "tool_use_id"):
            value = block.get(key)
            if value is not None and not isinstance(value, str):
                raise Refused(f"{where}[{j}].{key} must be a string", field=f"{where}[{j}].{key}")
        for key in ("input", "source"):
            value = block.get(key)
            if value is not None and not isinstance(value, Mapping):
                raise Refused(f"{where}[{j}].{key} must be an object", field=f"{where}[{j}].{key}")
        inner = block.get("content")
        if inner is not None and not (
            isinstance(inner, str)
            or (isinstance(inner, list) and all(isinstance(x, Mapping) for x in inner))
        ):
            raise Refused(
                f"{where}[{j}].content must be a string or a list of objects",
                field=f"{where}[{j}].content",
            )
        if kind in _TOOL_CHANGES:
            _tool_change(block.get("tool"), str(kind), f"{where}[{j}].tool")
    return content


def _tool_change(change: object, kind: str, where: str) -> None:
    """A tool_addition's or tool_removal's ``tool``: a reference by name, or (additions only)
    a definition (``AnthropicContentBlock.validate_tool_change``)."""
    ref = isinstance(change, Mapping) and change.get("type") == "tool_reference"
    if ref and isinstance(change, Mapping) and isinstance(change.get("name"), str):
        return
    defined = isinstance(change, Mapping) and change.get("type") == "tool_definition"
    if kind == "tool_addition" and defined and isinstance(change, Mapping):
        definition = change.get("definition")
        if isinstance(definition, Mapping) and isinstance(definition.get("name"), str):
            return
    want = '{"type": "tool_reference", "name": ...}'
    if kind == "tool_addition":
        want += ' or {"type": "tool_definition", "definition": {"name": ..., "input_schema": ...}}'
    raise Refused(f"{where} must be {want}", field=where)


def _system_text(raw: object, where: str, *, top: bool) -> str:
    """The top-level ``system``: a string as sent, or its text blocks joined (the billing
    header dropped)."""
    if raw is None or isinstance(raw, str):
        return raw or ""
    blocks = _blocks(raw, where)
    if top and any(b["type"] in _TOOL_CHANGES for b in blocks):
        raise Refused(
            "tool_addition and tool_removal blocks are only allowed in messages "
            'with role "system", not in `system`',
            field=where,
        )
    return "".join(
        b["text"]
        for b in blocks
        if b["type"] == "text" and b.get("text") and not b["text"].startswith(_BILLING_HEADER)
    )


def _inline_system(content: str | list[Mapping[str, Any]]) -> str:
    """A system message's text (``_extract_system_text``), "" for none."""
    if isinstance(content, str):
        return "" if content.startswith(_BILLING_HEADER) else content
    return _system_text(content, "messages", top=False)


def _convert_blocks(
    blocks: list[Mapping[str, Any]],
    role: str,
    converted: dict[str, Any],
    messages: list[dict[str, Any]],
    where: str,
) -> None:
    """``_convert_message_content``: a user's tool results become tool messages before it."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            # json.dumps with its defaults, as the engine writes the arguments.
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block.get("id") or "call_0",
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                _user_tool_result(block, messages, f"{where}[{j}]")
            else:
                inner = block.get("content")
                # str() of the block's content, a list's Python repr included, as there.
                parts.append(
                    {"type": "text", "text": f"Tool result: {str(inner) if inner else ''}"}
                )
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        converted["content"] = parts[0]["text"]
    elif parts:
        converted["content"] = parts


def _user_tool_result(block: Mapping[str, Any], messages: list[dict[str, Any]], where: str) -> None:
    """``_convert_user_tool_result``: the result as a tool message, its images as a user
    message after it, its tool references as another tool message."""
    inner = block.get("content")
    text = ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(inner, str):
        text = inner
    elif isinstance(inner, list):
        texts: list[str] = []
        for k, item in enumerate(inner):
            if not isinstance(item, Mapping):
                continue
            kind = item.get("type")
            if kind == "text":
                value = item.get("text", "")
                if not isinstance(value, str):
                    raise Refused(
                        f"{where}.content[{k}].text must be a string", field=f"{where}.content"
                    )
                texts.append(value)
            elif kind == "image":
                source = item.get("source", {})
                if not isinstance(source, Mapping):
                    raise Refused(
                        f"{where}.content[{k}].source must be an object", field=f"{where}.content"
                    )
                if url := _image_url(source):
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if images:
        messages.append(
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}} for url in images],
            }
        )
    if references:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _image_url(source: Mapping[str, Any]) -> str:
    """``_convert_image_source_to_url``: a URL source's URL, else a data URI."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _anthropic_tools(
    body: Mapping[str, Any], checked: list[tuple[str, str | list[Mapping[str, Any]]]]
) -> list[dict[str, Any]]:
    """``_convert_tools`` over ``_resolve_tools``: the declared tools with the system
    messages' tool_addition and tool_removal blocks applied in order."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise Refused(f"`tools` must be a list of tools; got {json_type(raw)}", field="tools")
    tools: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(raw or []):
        name = tool.get("name") if isinstance(tool, Mapping) else None
        if not isinstance(name, str):
            raise Refused(
                f"tools[{i}] must be an object with a string `name` and an `input_schema` object",
                field=f"tools[{i}]",
            )
        assert isinstance(tool, Mapping)
        tools[name] = tool
    removed: set[str] = set()
    for _, content in checked:
        if isinstance(content, str):
            continue
        for block in content:
            if block["type"] not in _TOOL_CHANGES:
                continue
            change = block["tool"]  # checked by _tool_change
            if change["type"] == "tool_definition":
                name = change["definition"]["name"]
                tools[name] = change["definition"]
            else:
                name = change["name"]
                if name not in tools:
                    raise Refused(
                        f"{block['type']} references tool {clip(str(name))!r}, which is not "
                        "declared in `tools`: declare it there first",
                        field="messages",
                    )
                if block["type"] == "tool_addition":
                    tools[name] = {**tools[name], "defer_loading": None}
            if block["type"] == "tool_removal":
                removed.add(name)
            else:
                removed.discard(name)
    out: list[dict[str, Any]] = []
    for i, (name, tool) in enumerate(tools.items()):
        if name in removed:
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise Refused(
                f"tool {clip(name)!r} needs an `input_schema` object (a JSON schema)",
                field=f"tools[{i}].input_schema",
            )
        if "type" not in schema:
            schema = {**schema, "type": "object"}  # the engine's default, added last as there
        shown = {
            "description": tool.get("description"),
            "parameters": schema,
            "strict": tool.get("strict"),
            "defer_loading": tool.get("defer_loading"),
        }
        out.append(function_tool(shown, f"tools[{i}]", name))
    return out


def _anthropic_effort(body: Mapping[str, Any], disabled_effort: str) -> str | None:
    """The reasoning effort the template sees: ``output_config.effort``, overridden by
    ``thinking: {"type": "disabled"}`` (``_handle_output_config``, then ``_handle_thinking``)."""
    effort = None
    config = body.get("output_config")
    if isinstance(config, Mapping) and isinstance(config.get("effort"), str):
        effort = config["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        effort = disabled_effort
    return effort
