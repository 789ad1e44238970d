"""The supervisor's pure core: desired shard set + what runs -> the actions to converge.

Level-triggered, like the control plane's reconcile: it is handed the whole
desired set and the whole local view every time and returns what to do now;
running it again after the actions took effect returns nothing. The shell
(supervisor.py) carries the actions out.

Rules (docs/architecture.md §4):
- start what is desired and missing; restart what exited once its backoff
  passed (at once when its spec changed: a new spec deserves a fresh try);
- adopt what survived an agent restart when its spec is still the desired
  one, replace it when not: a running engine is restarted only because its
  desired spec changed, never because this llmgw would build it differently;
- stop what is no longer desired, but never more than half of the live
  shards in one pass unless the control plane confirmed a drain: an empty
  or truncated desired set (a bug, a restored database) must not take a
  node down. Then none of those stops happen and they are reported as held;
- a desired spec the node cannot launch (refused by policy, invalid) never
  touches what runs: the old engine keeps serving.

This module must NOT do I/O, read the clock or import anything but the
standard library: `now` is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "Action",
    "ActionKind",
    "DesiredView",
    "Phase",
    "Plan",
    "RunningView",
    "compute_plan",
    "max_stops",
]

# unadopted: found alive after an agent restart, not yet claimed.
# live: a wrapper runs it (starting, ready or unhealthy alike).
# exited: its wrapper ended; a restart waits for restart_at.
# stopping: a stop is under way.
Phase = Literal["unadopted", "live", "exited", "stopping"]
ActionKind = Literal["start", "adopt", "replace", "stop", "forget", "suspend", "resume"]


@dataclass(frozen=True, slots=True)
class DesiredView:
    """One desired shard, reduced to what the diff decides on."""

    shard_id: str
    # Identifies the launch: the running process must carry the same.
    digest: str
    state: Literal["running", "suspended", "stopped"] = "running"
    # False when the node cannot launch this spec (policy, validation): it is
    # reported and what runs is left alone.
    launchable: bool = True
    # Whether the engine can free its GPUs without exiting; when not,
    # "suspended" means stopped.
    suspendable: bool = False


@dataclass(frozen=True, slots=True)
class RunningView:
    """One shard the node knows locally."""

    shard_id: str
    digest: str
    phase: Phase
    # For exited shards: the earliest time a restart may happen.
    restart_at: float = 0.0
    suspended: bool = False


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    shard_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...] = ()
    # Stops withheld by the half rule, for the shell to report.
    held_stops: tuple[str, ...] = ()
    # The shards not running whose restart waits on backoff.
    waiting: tuple[str, ...] = field(default=())

    def kinds(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for a in self.actions:
            out.setdefault(a.kind, []).append(a.shard_id)
        return out


def max_stops(num_live: int) -> int:
    """How many live shards one pass may stop without a confirmed drain.

    Half, rounded down, but at least one: a node running a single shard must
    still be able to give it up without an operator's drain.
    """
    return max(1, num_live // 2)


def _wants_process(d: DesiredView) -> bool:
    return d.state == "running" or (d.state == "suspended" and d.suspendable)


def compute_plan(
    desired: Mapping[str, DesiredView],
    running: Mapping[str, RunningView],
    *,
    now: float,
    confirmed_drain: bool = False,
) -> Plan:
    """The actions that move `running` toward `desired`, in shard-id order."""
    actions: list[Action] = []
    stops: list[Action] = []
    waiting: list[str] = []
    for sid in sorted(set(desired) | set(running)):
        d = desired.get(sid)
        r = running.get(sid)
        if d is not None and not d.launchable:
            # Unlaunchable: never start it, never stop what runs for it. An
            # exited one is left waiting: its old spec is no longer desired.
            if r is not None and r.phase == "unadopted":
                actions.append(Action("adopt", sid, "kept: the new spec cannot be launched"))
            continue
        if d is not None and _wants_process(d):
            if r is None:
                actions.append(Action("start", sid, "desired and not running"))
            elif r.phase == "unadopted":
                if r.digest == d.digest:
                    actions.append(Action("adopt", sid, "same spec after agent restart"))
                else:
                    actions.append(Action("replace", sid, "spec changed while the agent was away"))
            elif r.phase == "live":
                if r.digest != d.digest:
                    actions.append(Action("replace", sid, "desired spec changed"))
                elif d.state == "suspended" and not r.suspended:
                    actions.append(Action("suspend", sid, "desired suspended"))
                elif d.state == "running" and r.suspended:
                    actions.append(Action("resume", sid, "desired running"))
            elif r.phase == "exited":
                if r.digest != d.digest:
                    actions.append(Action("start", sid, "desired spec changed"))
                elif r.restart_at <= now:
                    actions.append(Action("start", sid, "restart after exit"))
                else:
                    waiting.append(sid)
            # stopping: wait for the stop to finish, then start next pass.
            continue
        # Not desired, desired stopped, or suspended on an engine that cannot suspend.
        if r is None or r.phase == "stopping":
            continue
        if r.phase == "exited":
            actions.append(Action("forget", sid, "exited and no longer desired"))
            continue
        why = "not desired" if d is None else f"desired {d.state}"
        stops.append(Action("stop", sid, why))
    num_live = sum(1 for r in running.values() if r.phase in ("live", "unadopted"))
    held: tuple[str, ...] = ()
    if stops and not confirmed_drain and len(stops) > max_stops(num_live):
        held = tuple(a.shard_id for a in stops)
        stops = []
    return Plan(actions=tuple(actions + stops), held_stops=held, waiting=tuple(waiting))
