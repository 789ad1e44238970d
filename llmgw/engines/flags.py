"""Reading a profile's passthrough args: the flags adapters reserve, and flag values.

Adapters set some flags themselves (bind address, port, parallelism, KV event
config). A passthrough arg that set one again would win or lose depending on
the engine's parser, and either way the engine would disagree with what the
agent health-checks, the router hashes or placement reserved, so such args are
refused, naming the profile field to use instead.

A flag is matched under every spelling the engine's own parser accepts
(`FlagSyntax`), not only the one in its docs: `--port=1`, `--po 1` under
argparse, `--kv-events-config.endpoint=...` under vLLM (its parser folds dotted
args into a JSON dict applied after llmgw's whole value), `--data_parallel_size`.
Matching errs towards refusing: a spelling that some parser would reject is
refused too, never one it would accept let through (issue 8 item 8).

This module must NOT interpret args beyond flag names and their values: it
never re-splits an arg (profiles hold argv lists, not shell strings).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from llmgw.errors import SpecError

__all__ = [
    "ARGPARSE",
    "ARGPARSE_NO_ABBREV",
    "CLICK",
    "EXACT",
    "FLAG_SYNTAX",
    "VLLM_SYNTAX",
    "FlagSyntax",
    "ReservedFlag",
    "arg_sets_flag",
    "check_reserved",
    "flag_value",
    "has_flag",
    "refused_flags",
    "syntax_for",
]


@dataclass(frozen=True, slots=True)
class FlagSyntax:
    """Which spellings of a flag an engine's argument parser accepts.

    Always accepted, so always matched: `--flag=value`, and `_` for `-` in a
    long flag's name (vLLM folds them; for the others folding only refuses more).
    """

    # argparse's allow_abbrev: any unambiguous prefix of a long flag (`--po`
    # for `--port`). argparse's default; vLLM and SGLang keep it.
    abbreviations: bool
    # argparse, whatever allow_abbrev says: a one-letter short flag takes its
    # value glued on (`-n2` is `-n 2`), and a short prefix names a longer
    # single-dash flag (`-t` is `-tp` when no other starts so).
    short_forms: bool
    # vLLM: `--flag.key value` or `-f.key=value` sets one key of a JSON flag,
    # merged and applied after every plain `--flag` (argparse_utils.py).
    dotted: bool = False


# Plain argparse: SGLang's launch_server (0.5.23, `argparse.ArgumentParser()`).
ARGPARSE = FlagSyntax(abbreviations=True, short_forms=True)
# Megatron builds its parser with allow_abbrev=False; argparse still glues short values.
ARGPARSE_NO_ABBREV = FlagSyntax(abbreviations=False, short_forms=True)
# vLLM's FlexibleArgumentParser (0.33, vllm/utils/argparse_utils.py): argparse
# with allow_abbrev left at its default True, plus dotted JSON keys and `_`->`-`.
VLLM_SYNTAX = FlagSyntax(abbreviations=True, short_forms=True, dotted=True)
# click (trtllm-serve, llmgw simengine via typer): exact names or `name=value`;
# click suggests a close name but never takes a prefix.
CLICK = FlagSyntax(abbreviations=False, short_forms=False)
# llama.cpp's own parser (common/arg.cpp) matches whole names only.
EXACT = FlagSyntax(abbreviations=False, short_forms=False)

# By engine name, so code holding only a profile (the agent's local policy)
# reads args exactly as the engine's adapter does.
FLAG_SYNTAX: dict[str, FlagSyntax] = {
    "vllm": VLLM_SYNTAX,
    "sglang": ARGPARSE,
    "megatron": ARGPARSE_NO_ABBREV,
    "trtllm": CLICK,
    "sim": CLICK,
    "llamacpp": EXACT,
}


@dataclass(frozen=True, slots=True)
class ReservedFlag:
    """A flag an adapter sets itself, under every name the engine gives it."""

    names: tuple[str, ...]
    # What to change instead: a profile field, or the party that sets it.
    use_instead: str


def _name(arg: str, syntax: FlagSyntax) -> str | None:
    """The flag name an arg spells, folded; None for an arg that is no flag."""
    if not arg.startswith("-") or arg in ("-", "--"):
        return None
    name = arg.split("=", 1)[0]
    if syntax.dotted and "." in name:
        # `--kv-events-config.endpoint` sets --kv-events-config (vLLM). The
        # part before the first dot is the flag, whatever follows.
        name = name.split(".", 1)[0]
    if name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    return name


def _fold(flag: str) -> str:
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def arg_sets_flag(arg: str, flag: str, syntax: FlagSyntax, known: Collection[str] = ()) -> bool:
    """Whether one argv element, read by this parser, sets `flag`.

    `known` are other flags the parser has: argparse takes an exact name
    before any prefix, so `--data-parallel-size` is that flag, not a prefix of
    `--data-parallel-size-local`.
    """
    given = _name(arg, syntax)
    if given is None:
        return False
    want = _fold(flag)
    if given == want:
        return True
    if given in {_fold(k) for k in known}:
        return False
    if given.startswith("--"):
        # An unambiguous prefix picks the flag; an ambiguous one is an error
        # in the engine, so refusing it too costs nothing.
        return (
            syntax.abbreviations
            and want.startswith("--")
            and len(given) > 2
            and want.startswith(given)
        )
    if not syntax.short_forms or want.startswith("--"):
        return False
    # Single dash under argparse: `-n2` is `-n 2` for a one-letter flag, and
    # `-t` a prefix of `-tp`. argparse tries an exact match against every
    # other flag first, so this refuses a real flag only if one starts with a
    # reserved one-letter flag (none in the engines read).
    if len(want) == 2 and given.startswith(want):
        return True
    return len(given) > 1 and want.startswith(given)


def _matches_any(
    arg: str, names: Collection[str], syntax: FlagSyntax, known: Collection[str] = ()
) -> bool:
    return any(arg_sets_flag(arg, n, syntax, known) for n in names)


def check_reserved(
    profile_name: str,
    engine: str,
    args: Sequence[str],
    reserved: Iterable[ReservedFlag],
    *,
    syntax: FlagSyntax,
    known: Collection[str] = (),
) -> None:
    """Raise SpecError for the first arg that sets a reserved flag, in any spelling.

    `known`: every flag name the adapter knows the engine has (see arg_sets_flag).
    """
    table = list(reserved)
    for i, arg in enumerate(args):
        for r in table:
            if _matches_any(arg, r.names, syntax, known):
                raise SpecError(
                    f"profile {profile_name!r}: args[{i}] {arg.split('=', 1)[0]!r} sets "
                    f"{r.names[0]}, which the {engine} adapter sets itself; remove it and "
                    f"use {r.use_instead} instead",
                    field="profile.args",
                )


def refused_flags(
    profile_args: Sequence[str],
    refused: Collection[str],
    engine: str,
    *,
    known: Collection[str] = (),
) -> list[str]:
    """The args that set any flag in `refused`, in every spelling `engine`'s parser accepts.

    For a node's local policy (issue 8 item 13): llmgw keeps args open, so the
    admin token can pass `--trust-remote-code` or `--worker-extension-cls` to
    every node; a node that refuses them calls this with its list and refuses
    the shard when anything comes back. Returns each offending arg as given,
    in order; an unknown engine is read with argparse's rules, the widest.
    `known` (an adapter's `known_flags()`) keeps a real flag that is a prefix of
    a refused one from being read as its abbreviation.
    """
    syntax = syntax_for(engine)
    return [a for a in profile_args if _matches_any(a, refused, syntax, known)]


def flag_value(
    args: Sequence[str], names: Sequence[str], syntax: FlagSyntax, known: Collection[str] = ()
) -> str | None:
    """The value the last spelling of a flag in args gives, as parsers keep the last.

    Dotted args (`--x.key=v`) set part of a JSON flag, not its value, and are
    skipped here; glued short values (`-q8`) are read.
    """
    found: str | None = None
    for i, arg in enumerate(args):
        if not _matches_any(arg, names, syntax, known):
            continue
        name = arg.split("=", 1)[0]
        if syntax.dotted and "." in name:
            continue
        if "=" in arg:
            found = arg.split("=", 1)[1]
        elif (
            not arg.startswith("--")
            and len(name) > 2
            and any(len(_fold(n)) == 2 and name.startswith(n) and name != n for n in names)
        ):
            found = name[2:]
        elif i + 1 < len(args):
            found = args[i + 1]
    return found


def has_flag(
    args: Sequence[str], names: Sequence[str], syntax: FlagSyntax, known: Collection[str] = ()
) -> bool:
    return any(_matches_any(a, names, syntax, known) for a in args)


def syntax_for(engine: str) -> FlagSyntax:
    """The engine's parser rules; an engine llmgw does not know gets argparse's, the widest."""
    return FLAG_SYNTAX.get(engine, VLLM_SYNTAX)
