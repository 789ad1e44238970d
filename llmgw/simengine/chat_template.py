"""The simulator's fixed chat template (ChatML): messages -> the exact text the engine tokenizes.

`/tokenize` with `messages` and `/v1/chat/completions` both render through
`render_chat`, so a router that tokenizes a conversation gets exactly the
tokens the engine will cache; two renderers would drift and every precise
routing decision would miss.

Must NOT tokenize or do I/O; it only builds a string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llmgw.errors import SpecError, clip
from llmgw.kv.hf_chat_template import check_chat_options

__all__ = ["render_chat"]


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise SpecError(
                    f"messages[{index}].content has a part of type {clip(str(kind))!r}; the "
                    "simulator serves text only: send text parts",
                    field=f"messages[{index}].content",
                )
        return "".join(parts)
    raise SpecError(
        f"messages[{index}].content is a {type(content).__name__}; send a string or a list of text parts",
        field=f"messages[{index}].content",
    )


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Any] | None = None,
) -> str:
    check_chat_options(
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    out: list[str] = []
    if tools:
        out.append(
            "<|im_start|>tools\n"
            + json.dumps(list(tools), sort_keys=True, separators=(",", ":"))
            + "<|im_end|>\n"
        )
    last = len(messages) - 1
    for index, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise SpecError(f"messages[{index}] has no role", field=f"messages[{index}].role")
        text = _content_text(message.get("content"), index)
        if continue_final_message and index == last:
            out.append(f"<|im_start|>{role}\n{text}")
        else:
            out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)
