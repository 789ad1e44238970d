"""The flags a profile's adapter_slots set on an engine that loads LoRA adapters at runtime.

Two sizes matter to every such engine: how many adapters it holds loaded at once (vLLM's and
the simulator's --max-cpu-loras, SGLang's --max-loaded-loras), which is what the leader
places up to and the agent counts as slots; and how many one batch may mix (--max-loras,
--max-loras-per-batch), which reserves GPU memory at start and must not exceed the first
(both engines refuse to start otherwise). The held size is llmgw's: args that set it to
something else are refused, naming both values, since the agent's count and the engine's would
disagree and loads would fail or evict each other. The batch size is a tuning knob: args may
set it, at most the held size.

This module must NOT decide whether an engine loads at runtime (Engine.runtime_adapters) nor
add the engine's switches (--enable-lora, the runtime-updating variable): each adapter does.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from llmgw.engines.flags import FlagSyntax, flag_value
from llmgw.engines.runtime_adapters import ADAPTERS_PER_BATCH
from llmgw.engines.spec import Profile
from llmgw.errors import SpecError

__all__ = ["SlotFlags", "int_flag", "slot_args"]


@dataclass(frozen=True, slots=True)
class SlotFlags:
    """An engine's names for the two sizes, every spelling its parser has."""

    held: tuple[str, ...]
    batch: tuple[str, ...]


def int_flag(
    profile: Profile,
    names: tuple[str, ...],
    syntax: FlagSyntax,
    known: Collection[str],
) -> int | None:
    """The whole number the profile's args give a flag (the last one, as parsers keep), None
    when they give none; SpecError for a value the engine's parser would refuse."""
    text = flag_value(profile.args, names, syntax, known)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise SpecError(
            f"profile {profile.name!r}: {names[0]} in args is {text!r}, not a whole number",
            field="profile.args",
        ) from None
    return value


def slot_args(
    profile: Profile,
    flags: SlotFlags,
    *,
    held: int,
    syntax: FlagSyntax,
    known: Collection[str],
    engine: str,
) -> list[str]:
    """The two size flags to add for ``held`` adapters (those the args do not set already), or
    SpecError naming the conflict. ``held`` is what the engine must hold: adapter_slots, plus
    the profile's own adapters where the engine counts those against the same limit."""
    given_held = int_flag(profile, flags.held, syntax, known)
    if given_held is not None and given_held != held:
        raise SpecError(
            f"profile {profile.name!r}: args set {flags.held[0]} {given_held}, but "
            f"adapter_slots {profile.adapter_slots} makes {engine} hold {held} adapters "
            f"({flags.held[0]} {held}); remove {flags.held[0]} from args and size it with "
            f"adapter_slots",
            field="profile.args",
        )
    given_batch = int_flag(profile, flags.batch, syntax, known)
    if given_batch is not None and not 1 <= given_batch <= held:
        raise SpecError(
            f"profile {profile.name!r}: args set {flags.batch[0]} {given_batch}, but {engine} "
            f"needs 1 to {flags.held[0]} ({held}, from adapter_slots {profile.adapter_slots}) "
            f"adapters per batch; lower it or raise adapter_slots",
            field="profile.args",
        )
    out: list[str] = []
    if given_batch is None:
        out += [flags.batch[0], str(min(held, ADAPTERS_PER_BATCH))]
    if given_held is None:
        out += [flags.held[0], str(held)]
    return out
