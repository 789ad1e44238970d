"""Pure: how many more requests a replica may be sent now (per-replica admission).

Each replica has a *ceiling*: its profile's ``max_in_flight``, or its engine's default
(``llmgw.engines.admission.default_max_in_flight``), carried by the route table. The gateway
never has more requests at a replica than its *limit* less what other gateways have there::

    room = floor(limit) - this gateway's in flight - others (engine's running + waiting,
                                                             less ours, at the last scrape)

The limit starts at the ceiling and moves by AIMD, as TCP's window does: a refused or reset
connection while the replica reports itself alive and loaded (``busy``) halves it (the engine,
or its listener, could not take what the ceiling promised: the profile overstates it, or
other traffic shares the engine); every success adds one back, up to the ceiling. Halving
keeps a burst of refusals from costing more than a few rounds; adding one per success
recovers a halved 512 in ~256 answers (a second at the simulator's rate), not a minute.

What it must NOT do: count requests (``load.LoadTracker`` does), or read a clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["AdmissionWindows"]

# A halved limit stays at least this: one request at a time still learns whether the
# replica recovered, and zero would stall its queue until the next scrape.
_MIN_LIMIT = 1.0


@dataclass(slots=True)
class _Window:
    ceiling: int
    limit: float


class AdmissionWindows:
    def __init__(self) -> None:
        self._windows: dict[str, _Window] = {}

    def configure(self, ceilings: Iterable[tuple[str, int]]) -> None:
        """The replicas and their ceilings, from the route table: new replicas start at their
        ceiling, a changed ceiling clips (or raises the cap of) the current limit, replicas
        not named are forgotten."""
        seen: set[str] = set()
        for replica, ceiling in ceilings:
            seen.add(replica)
            ceiling = max(1, ceiling)
            w = self._windows.get(replica)
            if w is None:
                self._windows[replica] = _Window(ceiling, float(ceiling))
            elif w.ceiling != ceiling:
                # A raised ceiling is grown into by successes, not jumped to: the limit may
                # be low because the replica was busy.
                was_full = w.limit >= w.ceiling
                w.ceiling = ceiling
                w.limit = float(ceiling) if was_full else min(w.limit, float(ceiling))
        for gone in [r for r in self._windows if r not in seen]:
            del self._windows[gone]

    def ceiling(self, replica: str) -> int | None:
        w = self._windows.get(replica)
        return None if w is None else w.ceiling

    def limit(self, replica: str) -> int | None:
        """The current limit (None: a replica the table has not named: unlimited)."""
        w = self._windows.get(replica)
        return None if w is None else int(w.limit)

    def room(self, replica: str, in_flight: int, others: int) -> int:
        """Requests the replica may be sent now; a large number for an unknown replica."""
        w = self._windows.get(replica)
        if w is None:
            return 1 << 30
        return int(w.limit) - in_flight - others

    def busy(self, replica: str) -> int:
        """The replica refused or reset while loaded: halve its limit; the new limit."""
        w = self._windows.get(replica)
        if w is None:
            return 0
        w.limit = max(_MIN_LIMIT, w.limit / 2)
        return int(w.limit)

    def succeeded(self, replica: str) -> None:
        w = self._windows.get(replica)
        if w is not None and w.limit < w.ceiling:
            w.limit = min(float(w.ceiling), w.limit + 1.0)

    def loaded(self, replica: str, load: int) -> bool:
        """Whether ``load`` (running + waiting, all gateways) is enough that a refusal reads
        as busy rather than broken: at least half the current limit. Below it a refused
        connection is a fault, and counts toward ejection."""
        w = self._windows.get(replica)
        return w is not None and load >= max(1.0, w.limit / 2)
