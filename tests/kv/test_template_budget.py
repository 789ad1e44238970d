"""A chat template renders within a budget (llmgw.kv.template_budget): the bombs of the
hardening issue's finding 2 (two and three nested range(15000) loops, 'x' * 4e9,
tojson(indent=1e9), strftime_now('%Y' * 2e8)) and their cousins fail fast with an error naming
what ran out, before they allocate; an ordinary template renders exactly as jinja2's plain
sandbox renders it; the output cap is the caller's "too long", the rest the template's; a
template that fails on a value of the messages (a null content) is the caller's error, as vLLM
answers it (400), never a 500."""

from __future__ import annotations

import json
import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmgw.errors import SpecError
from llmgw.kv.hf_tokenizer import HfTokenizer, TokenizerFiles
from llmgw.kv.template_budget import TemplateBudgetError
from llmgw.simengine.hf_tokens import read_tokenizer_dir, tiny_model_dir

TINY = read_tokenizer_dir(tiny_model_dir())
CHAT = [{"role": "user", "content": "hi"}]


def _tokenizer(template: str) -> HfTokenizer:
    config = json.loads(TINY.files["tokenizer_config.json"])
    config["chat_template"] = template
    return HfTokenizer(
        TokenizerFiles({**TINY.files, "tokenizer_config.json": json.dumps(config).encode()})
    )


BOMBS = {
    # finding 2's own
    "two nested loops": (
        "{% for i in range(15000) %}{% for j in range(15000) %}x{% endfor %}{% endfor %}",
        "steps",
    ),
    "three nested loops": (
        "{% for i in range(15000) %}{% for j in range(15000) %}{% for k in range(15000) %}"
        "{% endfor %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "string times 4e9": ("{{ 'x' * 4000000000 }}", "built"),
    "tojson indent 1e9": ("{{ messages | tojson(indent=1000000000) }}", "built"),
    "strftime_now format 2e8": ("{{ strftime_now('%Y' * 200000000) }}", "built"),
    # their cousins
    "doubling by ~": (
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "built",
    ),
    "doubling by +": (
        "{% set ns = namespace(s=['x']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "built",
    ),
    "ljust": ("{{ 'x'.ljust(10 ** 10) }}", "built"),
    "center filter": ("{{ 'x' | center(10 ** 10) }}", "built"),
    "power": ("{{ 10 ** (10 ** 10) }}", "built"),
    "format width": ("{{ '{:>9999999999}'.format(1) }}", "built"),
    "percent width": ("{{ '%*s' % (10 ** 9, 'x') }}", "built"),
    "exponential macro": (
        "{% macro a(n) %}{% if n %}{{ a(n - 1) }}{{ a(n - 1) }}{% endif %}{% endmacro %}"
        "{{ a(40) }}",
        "steps",
    ),
    "list times 1e8": ("{{ (messages * 100000000) | length }}", "built"),
    "long strftime format": ("{{ strftime_now('%Y' * 200) }}", "built"),
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_bomb_fails_fast_naming_what_ran_out(name: str) -> None:
    template, what = BOMBS[name]
    tok = _tokenizer(template)
    started = time.perf_counter()
    with pytest.raises(TemplateBudgetError) as caught:
        tok.render_chat(CHAT, max_chars=1_000_000)
    took = time.perf_counter() - started
    assert caught.value.what == what, caught.value.message
    assert took < 1.0, took
    # A SpecError: whoever calls render_chat already handles it (no 500 anywhere).
    assert isinstance(caught.value, SpecError)


def test_the_output_cap_is_the_rendered_text_not_the_request_text() -> None:
    # 160,000 empty messages: no text of their own, ~28 characters each once rendered.
    tok = HfTokenizer(TINY)
    chat = [{"role": "user", "content": ""}] * 160_000
    started = time.perf_counter()
    with pytest.raises(TemplateBudgetError) as caught:
        tok.render_chat(chat, max_chars=1_000_000)
    assert caught.value.what == "output"
    assert "over 1000000 characters" in caught.value.message
    assert time.perf_counter() - started < 2.0
    # Under the cap it renders, and a budget that grows with the chat lets a long one through.
    assert len(tok.render_chat(chat[:30_000], max_chars=1_000_000)) > 800_000
    with pytest.raises(TemplateBudgetError, match="prompt is 2000 characters"):
        tok.render_request({"prompt": "x" * 2000}, chat=False, max_chars=1000)


def test_a_template_failing_on_the_messages_values_is_the_callers_error() -> None:
    # The tiny model's template concatenates the role: a number is a TypeError. (A null
    # content is not: vLLM hands the template empty text for it, and so does the gateway.)
    assert HfTokenizer(TINY).render_chat([{"role": "user", "content": None}]) == (
        HfTokenizer(TINY).render_chat([{"role": "user", "content": ""}])
    )
    with pytest.raises(SpecError) as caught:
        HfTokenizer(TINY).render_chat([{"role": 5, "content": "hi"}])
    assert caught.value.field == "messages" and "TypeError" in caught.value.message
    assert type(caught.value) is SpecError  # the body's fault, not the template's budget
    with pytest.raises(SpecError, match="ValueError") as caught:
        _tokenizer("{{ messages[0].content.index('zzz') }}").render_chat(CHAT)
    assert caught.value.field == "messages"
    # Through render_request too, as the simulator and the workers call it.
    with pytest.raises(SpecError, match="messages"):
        HfTokenizer(TINY).render_request({"messages": [{"role": 5, "content": "hi"}]}, chat=True)


TEMPLATES = [
    json.loads(TINY.files["tokenizer_config.json"])["chat_template"],
    # loops with loop.*, namespace, tojson, filters, macros, string methods
    "{% set ns = namespace(n=0) %}{% macro line(m) %}[{{ m.role | upper }}]{% endmacro %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ line(m) }}{{ loop.index }}/"
    "{{ loop.length }}{% if loop.last %}!{% endif %} {{ m.content | trim | replace('a', 'b') }}"
    "{{ m.content.strip().split(' ') | join('_') }}{% endfor %}{{ ns.n }}"
    "{{ tools | tojson }}{{ tools | tojson(indent=2) }}{{ '%s-%d' % ('x', 3) }}"
    "{{ '{}:{}'.format('a', 1) }}{{ 'ab' * 3 }}{{ [1, 2] + [3] }}"
    "{% for m in messages | selectattr('role', 'equalto', 'user') %}{{ m.content }}{% endfor %}"
    "{% for m in messages[::-1] %}{% if m.role == 'user' %}{{ m.content }}{% break %}"
    "{% endif %}{% endfor %}",
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_an_ordinary_template_renders_as_the_plain_sandbox_renders_it(template: str) -> None:
    from llmgw.kv.template_budget import _tojson

    chat = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": " a banana a day "},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and again"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": [1, 2]}}}]
    plain = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    plain.filters["tojson"] = _tojson
    want = plain.from_string(template).render(
        messages=chat, tools=tools, add_generation_prompt=True, **_specials()
    )
    assert _tokenizer(template).render_chat(chat, tools=tools, max_chars=1_000_000) == want


def _specials() -> dict[str, str]:
    config = json.loads(TINY.files["tokenizer_config.json"])
    return {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}


_ROLES = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"


def test_developer_messages_render_as_vllm_renders_them() -> None:
    chat = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {
            "role": "developer",
            "content": [{"type": "text", "text": "d1"}, {"type": "text", "text": "d2"}],
        },
        {"role": "developer", "content": ""},
    ]
    # A template that does not name the role: each developer message becomes a system one,
    # and all system messages merge at the front, joined by a blank line, empty ones left out.
    assert _tokenizer(_ROLES).render_chat(chat) == "[system:s\n\nd1\nd2][user:u]"
    # One system message already first and no developer one: nothing changes.
    assert _tokenizer(_ROLES).render_chat(chat[:2]) == "[system:s][user:u]"
    # A lone developer message first: renamed, not merged with anything.
    alone = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    assert _tokenizer(_ROLES).render_chat(alone) == "[system:d][user:u]"
    # A template that names it renders it as sent.
    knows = "{# 'developer' #}" + _ROLES
    assert _tokenizer(knows).render_chat(chat[:3]) == "[system:s][user:u][developer:d1\nd2]"
