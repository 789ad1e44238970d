"""CPU cores for CPU shards: placement reserves a count of threads per node, the agent picks
which cores.

A shard keeps its cores for its life on the node (``ShardSpec.cpu_cores``, in its record), as
it keeps its ports: an adopted engine still runs its threads where it did before the agent
restarted, so a restarted agent holds them again from the record and gives them to no other
shard. A start picks the lowest free CPU ids (neighbours share caches and, on most machines,
a NUMA node).

A node may have fewer free cores than placement reserved: an inventory that claims more
threads than exist (``agent.cpu_threads``, a test's fake inventory), or CPUs taken from the
agent since its shards started. Then cores are shared rather than the start refused: every free
one, then the ones the fewest shards hold, never more than the node has (a shard of 8 threads
on 2 CPUs gets both); the pick says it came up short, for the caller to warn.

This module must NOT read the node's CPUs or log: the launcher passes the ids in and reports.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CoreAllocator", "CorePick"]


@dataclass(frozen=True, slots=True)
class CorePick:
    cores: tuple[int, ...]
    # The node had fewer free cores than threads asked for: some of these are another shard's
    # too, or there are fewer of them than threads.
    short: bool = False


class CoreAllocator:
    def __init__(self, cpus: Iterable[int]) -> None:
        # The CPUs shards may be given: those the agent may run on (os.sched_getaffinity).
        self._cpus = tuple(sorted(set(cpus)))
        # Core -> shards holding it: counted, because a shared core is held by several and
        # stays taken until the last of them lets it go.
        self._holders: dict[int, int] = {}

    @property
    def cpus(self) -> tuple[int, ...]:
        return self._cpus

    def size_for(self, threads: int) -> int:
        """How many cores a shard of ``threads`` gets: never more than the node has."""
        return max(0, min(threads, len(self._cpus)))

    def hold(self, cores: Iterable[int]) -> None:
        """Mark cores in use (by a recovered record), whether or not among ``cpus``."""
        for c in cores:
            self._holders[c] = self._holders.get(c, 0) + 1

    def release(self, cores: Iterable[int]) -> None:
        for c in cores:
            left = self._holders.get(c, 0) - 1
            if left > 0:
                self._holders[c] = left
            else:
                self._holders.pop(c, None)

    def num_holders(self, core: int) -> int:
        return self._holders.get(core, 0)

    def allocate(self, threads: int) -> CorePick:
        """``size_for(threads)`` cores, now held: free ones first, lowest id first."""
        n = self.size_for(threads)
        if n == 0:
            return CorePick(())
        free = [c for c in self._cpus if c not in self._holders]
        picked = free[:n]
        if len(picked) < n:
            busy = sorted((c for c in self._cpus if c in self._holders), key=self._load)
            picked += busy[: n - len(picked)]
        cores = tuple(sorted(picked))
        self.hold(cores)
        return CorePick(cores, short=len(free) < threads)

    def _load(self, core: int) -> tuple[int, int]:
        return self._holders.get(core, 0), core
