"""Rollout arithmetic: surge and unavailability budgets, as Kubernetes resolves them.

`max_surge` and `max_unavailable` are counts ("1") or shares of the desired
replicas ("25%"). Surge rounds up and unavailability down, so a small
deployment can always add one replica but never loses more than it allows;
when both come to zero unavailability becomes 1, since 0/0 could never make
progress (the database refuses 0/0 as written, this covers "10%" of 3).
Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from llmgw.errors import SpecError

__all__ = ["RolloutBudget", "resolve_budget", "rollout_budget"]

_BUDGET = re.compile(r"^(0|[1-9][0-9]{0,5})(%?)$")


def resolve_budget(value: str, desired: int, *, round_up: bool, field: str) -> int:
    """A count or percentage of `desired` as a number of replicas."""
    m = _BUDGET.match(value.strip())
    if m is None:
        raise SpecError(
            f"{field} {value!r} is neither a count nor a percentage; write e.g. '1' or '25%'",
            field=field,
        )
    n = int(m.group(1))
    if not m.group(2):
        return n
    share = desired * n / 100
    return math.ceil(share) if round_up else math.floor(share)


@dataclass(frozen=True, slots=True)
class RolloutBudget:
    # Replicas above desired that may exist during a rollout.
    max_surge: int
    # Desired replicas that may be unready during a rollout.
    max_unavailable: int


def rollout_budget(max_surge: str, max_unavailable: str, desired: int) -> RolloutBudget:
    surge = resolve_budget(max_surge, desired, round_up=True, field="max_surge")
    unavailable = resolve_budget(max_unavailable, desired, round_up=False, field="max_unavailable")
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return RolloutBudget(surge, unavailable)
