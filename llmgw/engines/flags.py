"""Reading a profile's passthrough args: the flags adapters reserve, and flag values.

Adapters set some flags themselves (bind address, port, parallelism, KV event
config). A passthrough arg that set one again would win or lose depending on
the engine's parser, and either way the engine would disagree with what the
agent health-checks, the router hashes or placement reserved, so such args are
refused, naming the profile field to use instead.

This module must NOT interpret args beyond flag names and their values: it
never re-splits an arg (profiles hold argv lists, not shell strings).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmgw.errors import SpecError

__all__ = ["ReservedFlag", "check_reserved", "flag_value", "has_flag"]


@dataclass(frozen=True, slots=True)
class ReservedFlag:
    """A flag an adapter sets itself, under every spelling the engine accepts."""

    names: tuple[str, ...]
    # What to change instead: a profile field, or the party that sets it.
    use_instead: str


def _canon(flag: str) -> str:
    # vLLM's parser (and TensorRT-LLM's click options, spelled with `_`)
    # treat - and _ alike in long flags; folding both ways can only refuse
    # more, never let an override through.
    name = flag.split("=", 1)[0]
    if name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    return name


def _matches(arg: str, name: str, *, abbreviations: bool) -> bool:
    if not arg.startswith("-"):
        return False
    given, want = _canon(arg), _canon(name)
    if given == want:
        return True
    # argparse accepts any unambiguous prefix of a long flag (`--po` for
    # `--port`) unless a parser turns that off, which not every engine does.
    return (
        abbreviations
        and given.startswith("--")
        and want.startswith("--")
        and len(given) >= 3
        and want.startswith(given)
    )


def check_reserved(
    profile_name: str,
    engine: str,
    args: Sequence[str],
    reserved: Iterable[ReservedFlag],
    *,
    abbreviations: bool,
) -> None:
    """Raise SpecError for the first arg that sets a reserved flag."""
    table = list(reserved)
    for i, arg in enumerate(args):
        for r in table:
            for name in r.names:
                if _matches(arg, name, abbreviations=abbreviations):
                    spelled = " ".join(args[i : i + 2]) if "=" not in arg else arg
                    raise SpecError(
                        f"profile {profile_name!r}: args {spelled!r} sets {r.names[0]}, "
                        f"which the {engine} adapter sets itself; remove it and "
                        f"use {r.use_instead} instead",
                        field="profile.args",
                    )


def flag_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value the last `name value` or `name=value` in args gives, as parsers keep the last."""
    canon = {_canon(n) for n in names}
    found: str | None = None
    for i, arg in enumerate(args):
        if not arg.startswith("-") or _canon(arg) not in canon:
            continue
        if "=" in arg:
            found = arg.split("=", 1)[1]
        elif i + 1 < len(args):
            found = args[i + 1]
    return found


def has_flag(args: Sequence[str], names: Sequence[str]) -> bool:
    canon = {_canon(n) for n in names}
    return any(a.startswith("-") and _canon(a) in canon for a in args)
