"""The engine's control state machine, as Megatron-core's coordinator allows it.

    pause    RUNNING   -> PAUSED      (ignored when already PAUSED or SUSPENDED)
    unpause  PAUSED    -> RUNNING
    suspend  PAUSED    -> SUSPENDED   (the shell frees the whole KV cache)
    resume   SUSPENDED -> PAUSED      (unpause afterwards to run again)

Megatron drops any other combination after logging it; over HTTP a silent
drop would let an operator believe a suspend happened, so here it is a
ConflictError naming the state and the signal that would work. Submitting
requests is not gated by state (they queue while paused or suspended).

Must NOT touch the cache or do I/O: it only computes the next state.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Literal

from llmgw.errors import ConflictError

__all__ = ["ControlSignal", "EngineState", "apply_signal"]


class EngineState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"


ControlSignal = Literal["pause", "unpause", "suspend", "resume"]

_TRANSITIONS: Final[dict[str, tuple[EngineState, EngineState]]] = {
    "pause": (EngineState.RUNNING, EngineState.PAUSED),
    "unpause": (EngineState.PAUSED, EngineState.RUNNING),
    "suspend": (EngineState.PAUSED, EngineState.SUSPENDED),
    "resume": (EngineState.SUSPENDED, EngineState.PAUSED),
}
_IGNORED: Final[dict[str, frozenset[EngineState]]] = {
    "pause": frozenset({EngineState.PAUSED, EngineState.SUSPENDED}),
}
_HINT: Final[dict[EngineState, str]] = {
    EngineState.RUNNING: "pause first",
    EngineState.PAUSED: "unpause to run, or suspend to free the cache",
    EngineState.SUSPENDED: "resume first (it returns to paused)",
}


def apply_signal(state: EngineState, signal: ControlSignal) -> EngineState:
    """The state after `signal`; the same state when Megatron ignores it there."""
    if signal not in _TRANSITIONS:
        raise ConflictError(
            f"control signal {signal!r} is unknown; use one of {', '.join(_TRANSITIONS)}"
        )
    source, target = _TRANSITIONS[signal]
    if state == source:
        return target
    if state in _IGNORED.get(signal, frozenset()):
        return state
    raise ConflictError(
        f"cannot {signal} an engine that is {state.value}: {signal} is allowed only from "
        f"{source.value}; {_HINT[state]}"
    )
