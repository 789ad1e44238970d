"""A chat rendered as ``transformers.apply_chat_template`` renders it, for ``HfTokenizer``: the
template environment HF templates expect (jinja2's immutable sandbox with ``trim_blocks``,
``lstrip_blocks`` and loop controls, transformers' ``tojson`` filter, the ``raise_exception`` and
``strftime_now`` globals; every render within a budget of steps and characters:
``template_budget``), which of a tokenizer's templates a request uses, a message's content
as vLLM hands it to the template, and the options every template refuses before rendering.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError

from llmgw.errors import SpecError, clip
from llmgw.kv.template_budget import BudgetedSandbox, strftime_format

__all__ = ["check_chat_options", "message_text", "pick_template", "template_environment"]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    # The one clock a template may read (Llama 3's date line), as transformers gives it; its
    # format is capped (its output grows with it).
    return datetime.now().strftime(strftime_format(fmt))


def template_environment() -> BudgetedSandbox:
    """The environment HF templates expect, every render of it bounded (``template_budget``:
    rendered with ``render_within``)."""
    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def pick_template(config: Mapping[str, Any], files: Mapping[str, bytes], tools: bool) -> str:
    """The template source a request uses ("" when there is none): chat_template.jinja, else
    tokenizer_config.json's ``chat_template``, a string or named templates."""
    raw = files.get("chat_template.jinja")
    if raw is not None:
        return raw.decode("utf-8")
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # Named templates: "tool_use" for a request with tools where there is one, else
        # "default", as transformers picks.
        named = {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, Mapping)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
        if tools and "tool_use" in named:
            return str(named["tool_use"])
        if "default" in named:
            return str(named["default"])
    return ""


def knows_developer_role(source: str) -> bool:
    """Whether a chat template renders OpenAI's ``developer`` role itself (vLLM 0.32's test,
    vllm/renderers/hf.py ``_detect_developer_role_support``: the role's name quoted in it)."""
    return '"developer"' in source or "'developer'" in source


def developer_as_system(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chat with ``developer`` messages as a template that does not know the role gets it
    from vLLM (``_convert_developer_to_system`` then ``_consolidate_system_messages``): each
    becomes ``system`` (its ``tools`` dropped), and where a system message is then not alone
    at the front, all of them merge into one at the front, joined by a blank line, empty
    ones left out. Call it with the contents already text (``message_text``)."""
    converted: list[dict[str, Any]] = []
    for message in chat:
        if message.get("role") == "developer":
            message = {k: v for k, v in message.items() if k != "tools"} | {"role": "system"}
        converted.append(message)
    systems = [i for i, m in enumerate(converted) if m.get("role") == "system"]
    if not systems or systems == [0]:
        return converted
    texts = [str(c) for i in systems if (c := converted[i].get("content"))]
    rest = [m for m in converted if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def message_text(content: Any) -> str:
    """The text of a message's content as vLLM hands it to the template ("string" content
    format): a list of text parts is joined with newlines, and no content (null or absent:
    an assistant turn of tool calls only) is empty text, as vLLM 0.32 renders it
    (vllm/renderers/chat_utils.py ``_parse_chat_message_content``: None is no parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise SpecError(
                    f"content part {i} is of type {clip(str(kind))!r}: only text parts are "
                    "rendered here",
                    field="messages",
                )
        return "\n".join(texts)
    raise SpecError(
        f"a message's content is a {type(content).__name__}; send a string or a list of text parts",
        field="messages",
    )


def check_chat_options(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> None:
    """What every chat template refuses before rendering, as vLLM refuses it: the final
    message cannot be both closed (a generation prompt) and continued, and a chat has one."""
    if add_generation_prompt and continue_final_message:
        raise SpecError(
            "add_generation_prompt and continue_final_message are both true; "
            "set add_generation_prompt=false to continue the final message",
            field="continue_final_message",
        )
    if not messages:
        raise SpecError("messages is empty; send at least one message", field="messages")
