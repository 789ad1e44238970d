"""A chat template rendered within a budget: steps, characters built and characters output.

A chat template is code a node uploads (``hf_chat_template``), run on every chat the gateway
tokenizes. jinja2's sandbox keeps it from Python's internals but not from running forever or
exhausting memory: two nested ``range(15000)`` loops, ``'x' * 4e9``, ``tojson(indent=1e9)``,
``strftime_now('%Y' * 2e8)``. ``BudgetedSandbox`` makes each of them fail fast with
``TemplateBudgetError`` naming what ran out, by charging one render's ``Budget``:

- steps: one per loop iteration (every ``for`` loop's iterable passes through ``llmgw_steps``,
  charged its length up front where it has one: ``range(100000)`` costs 100000 at once) and one
  per call (macros, methods, ``loop(...)`` of a recursive loop);
- built: the size of every string or list an operator, a filter, a ``~`` concatenation or a
  method call makes (``+`` and ``*`` are checked before they run, so ``'x' * 4e9`` never
  allocates);
- output: the characters the template yields, at most ``max_output``.

An integer argument larger than the output cap (``'x'.ljust(10**9)``, ``|center(10**9)``), a
format string with a width that size, and a power or product of integers past 64 kbit are
refused before they run. What escapes these checks is bounded by the process: the gateway
renders in worker processes with a memory limit and a deadline (``llmgw.tokenizing``).

The budget is per render (a context variable, so concurrent renders on threads do not share
one); rendering outside ``render_within`` charges nothing.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final

from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from llmgw.errors import SpecError

__all__ = [
    "BASE_STEPS",
    "Budget",
    "BudgetedSandbox",
    "TemplateBudgetError",
    "budget_for",
    "render_within",
    "strftime_format",
]

# Steps every render may take whatever its input, and steps per item of the input (a message,
# a tool, an entry of a list-valued template argument): templates walk their messages a few
# times (Qwen3's walks them twice); a quadratic one is not a chat template.
BASE_STEPS: Final = 10_000
STEPS_PER_ITEM: Final = 64
# Characters (or list items) operators, filters and calls may build, per character output: a
# template builds each message's text a few times over (``a + b + c`` makes each prefix).
BUILT_PER_OUTPUT: Final = 16
# Past this many bits an integer is not a number a chat needs (2**65536 takes 8 KB).
_MAX_INT_BITS: Final = 65_536
_MAX_INDENT: Final = 64
_MAX_STRFTIME_FORMAT: Final = 256
_WIDE_FORMAT = re.compile(r"\d{7,}")


class TemplateBudgetError(SpecError):
    """The render ran out of ``what`` ("steps", "built" or "output"): the message names the
    limit. ``output`` is the caller's (a prompt too long to render); the others the template's."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


@dataclass(slots=True)
class Budget:
    max_steps: int
    max_built: int
    max_output: int
    steps: int = 0
    built: int = 0
    output: int = 0

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.max_steps:
            raise TemplateBudgetError(
                "steps",
                f"the chat template took over {self.max_steps} steps (loop iterations and "
                "calls) for this chat; a template's work must grow with its chat, not faster",
            )

    def build(self, size: int) -> None:
        if size > self.max_output:
            # The template's, not the chat's: the caller bounds the chat's own text first.
            raise TemplateBudgetError(
                "built",
                f"the chat template built a value of {size} characters, over the cap of "
                f"{self.max_output}",
            )
        self.built += size
        if self.built > self.max_built:
            raise TemplateBudgetError(
                "built",
                f"the chat template built over {self.max_built} characters for this chat",
            )

    def emit(self, size: int) -> None:
        self.output += size
        if self.output > self.max_output:
            raise TemplateBudgetError(
                "output",
                f"the rendered prompt is over {self.max_output} characters",
            )


_BUDGET: ContextVar[Budget | None] = ContextVar("llmgw_template_budget", default=None)


def budget_for(context: dict[str, Any], max_output: int) -> Budget:
    """The budget of one render of ``context`` (its lists' items count: messages, tools, a
    documents argument), its output capped at ``max_output`` characters."""
    items = sum(len(v) for v in context.values() if isinstance(v, list | tuple | dict))
    return Budget(
        max_steps=BASE_STEPS + STEPS_PER_ITEM * items,
        max_built=BUILT_PER_OUTPUT * max_output + 1_000_000,
        max_output=max_output,
    )


def render_within(template: Any, context: dict[str, Any], budget: Budget) -> str:
    """``template.render(**context)`` charged to ``budget`` (``TemplateBudgetError`` when it
    runs out); the output is counted as it is yielded, never joined past the cap."""
    token = _BUDGET.set(budget)
    try:
        parts: list[str] = []
        for part in template.generate(**context):
            budget.emit(len(part))
            parts.append(part)
        return "".join(parts)
    finally:
        _BUDGET.reset(token)


def _size(value: Any) -> int | None:
    if isinstance(value, str | list | tuple | dict | bytes):
        return len(value)
    return None


def _charge_built(value: Any) -> Any:
    budget = _BUDGET.get()
    if budget is not None:
        size = _size(value)
        if size is not None:
            budget.build(size)
    return value


def _check_args(args: Iterable[Any]) -> None:
    budget = _BUDGET.get()
    if budget is None:
        return
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > budget.max_output:
            raise TemplateBudgetError(
                "built", f"an argument of {arg} is over the output cap of {budget.max_output}"
            )


def _steps(value: Any) -> Any:
    """Every ``for`` loop's iterable: charged its length at once, or an item at a time."""
    budget = _BUDGET.get()
    if budget is None:
        return value
    try:
        n = len(value)
    except TypeError:
        return _counted(value, budget)
    budget.step(n)
    return value


def _counted(value: Iterable[Any], budget: Budget) -> Iterator[Any]:
    for item in value:
        budget.step()
        yield item


class _Instrument(NodeTransformer):
    """Every ``for`` loop's iterable through ``llmgw_steps``, every ``~`` through
    ``llmgw_built`` (both filters: a template cannot shadow a filter as it can a name)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "llmgw_steps", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(node, "llmgw_built", [], [], None, None, lineno=node.lineno)


def _guarded_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_args(args)
        _check_args(kwargs.values())
        return _charge_built(f(*args, **kwargs))

    return guarded


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' own tojson: jinja2's escapes HTML characters, which a prompt must keep.
    # Indented output is built a piece at a time and counted: an indent times a deep value's
    # lines is the one way this filter's output outgrows its input.
    if (isinstance(indent, str) and len(indent) > _MAX_INDENT) or (
        isinstance(indent, int) and indent > _MAX_INDENT
    ):
        raise TemplateBudgetError("built", f"tojson's indent is over {_MAX_INDENT}")
    encoder = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    budget = _BUDGET.get()
    if indent is None or budget is None:
        return encoder.encode(value)
    parts: list[str] = []
    size = 0
    for part in encoder.iterencode(value):
        size += len(part)
        if size > budget.max_output:
            budget.build(size)
        parts.append(part)
    return "".join(parts)


def strftime_format(fmt: str) -> str:
    """The format ``strftime_now`` may take (its output grows with it)."""
    if len(fmt) > _MAX_STRFTIME_FORMAT:
        raise TemplateBudgetError(
            "built", f"strftime_now's format is over {_MAX_STRFTIME_FORMAT} characters"
        )
    return fmt


def _checked_binop(op: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be past the caps, before it runs."""
    budget = _BUDGET.get()
    if budget is None:
        return
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            size = _size(seq)
            if size is not None and isinstance(n, int):
                budget.build(size * max(n, 0))
                return
        if (
            isinstance(left, int)
            and isinstance(right, int)
            and abs(left).bit_length() + abs(right).bit_length() > _MAX_INT_BITS
        ):
            raise TemplateBudgetError("built", "an integer product is over 64 kbit")
    elif op == "+":
        a, b = _size(left), _size(right)
        if a is not None and b is not None:
            budget.build(a + b)
    elif op == "**" and isinstance(left, int) and isinstance(right, int):
        if right > 0 and abs(left).bit_length() * right > _MAX_INT_BITS:
            raise TemplateBudgetError("built", "an integer power is over 64 kbit")
    elif op == "%" and isinstance(left, str):
        if _WIDE_FORMAT.search(left):
            raise TemplateBudgetError("built", "a format width is over the output cap")
        _check_args(right if isinstance(right, tuple) else (right,))


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, every render charged to the current ``Budget``."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(extensions=[loopcontrols], **kwargs)
        self.filters = {name: _guarded_filter(f) for name, f in self.filters.items()}
        self.filters["llmgw_steps"] = _steps
        self.filters["llmgw_built"] = _charge_built
        self.filters["tojson"] = _tojson

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        _Instrument().visit(tree)
        return tree

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _checked_binop(operator, left, right)
        return _charge_built(self.binop_table[operator](left, right))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.step()
            _check_args(args)
            _check_args(kwargs.values())
        return _charge_built(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _WIDE_FORMAT.search(getattr(value, "__self__", "")):
            raise TemplateBudgetError("built", "a format width is over the output cap")
        return wrapped
