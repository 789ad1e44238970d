"""Pure: the order in which a model's queued requests leave the gateway's queue.

One ``FairQueue`` per model holds the requests no replica can admit now. Fairness is across
API keys, in the spirit of virtual token counters (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024): every key has a counter of the tokens it was served recently,
divided by its weight (``priority + 1``); the next request to leave is the head of the key
with the lowest counter (ties: the older head). Within a key, first in, first out.

Why counters and not round-robin: a key bursting 3,000 short prompts and a key sending a
steady trickle of long ones are served the same *tokens*, not the same request counts. Why
the lift on arrival: a key whose queue was empty joins at no less than the lowest counter of
the keys waiting (or of the last key served, when none waits), so a key idle for an hour
cannot bank credit and then starve everyone with a burst; that lift is what makes the counter
"recent".

Bounds: ``max_requests`` and ``max_bytes`` (the bodies held) over the whole queue; ``push``
refuses past them and says which bound was hit, so the shell sheds with a reason. A request
leaving early (its wait bound, its client gone) is ``remove``d in O(1): marked, counted out at
once, and skipped when it reaches its key's head (compacted when marks outnumber the living,
so a queue that never drains cannot hold the dead forever).

``DrainRate`` estimates how fast the queue empties (requests leaving for a replica per
second, a moving average over windows) so a shed request's ``Retry-After`` says when there is
likely room.

What it must NOT do: read a clock (the shell passes ``now``), await, or know what an item is.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

__all__ = ["DrainRate", "Entry", "FairQueue", "Refusal"]

T = TypeVar("T")

Refusal = Literal["queue_requests", "queue_bytes"]


@dataclass(slots=True, eq=False)
class Entry(Generic[T]):
    """One queued request. ``item`` is the shell's (a future to resolve)."""

    key: str
    item: T
    size_bytes: int
    enqueued_at: float
    seq: int
    gone: bool = False


@dataclass(slots=True)
class _Key(Generic[T]):
    weight: float
    counter: float = 0.0
    entries: deque[Entry[T]] = field(default_factory=deque)
    live: int = 0  # entries not gone


class FairQueue(Generic[T]):
    def __init__(self, *, max_requests: int, max_bytes: int) -> None:
        if max_requests < 0 or max_bytes < 0:
            raise ValueError("queue bounds are counts: 0 or more")
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._keys: dict[str, _Key[T]] = {}
        self._active: set[str] = set()  # keys with a live entry
        self._seq = itertools.count()
        self._floor = 0.0  # the counter of the key served last: where a newcomer joins
        self.num_requests = 0
        self.num_bytes = 0

    def __len__(self) -> int:
        return self.num_requests

    def push(
        self, key: str, item: T, *, size_bytes: int, now: float, priority: int = 0
    ) -> Entry[T] | Refusal:
        """Queue ``item`` for ``key``, or say which bound refuses it."""
        if self.num_requests + 1 > self.max_requests:
            return "queue_requests"
        if self.num_bytes + size_bytes > self.max_bytes:
            return "queue_bytes"
        state = self._keys.get(key)
        weight = float(max(0, priority) + 1)
        if state is None:
            state = self._keys[key] = _Key(weight, counter=self._floor)
        state.weight = weight
        if state.live == 0:
            # The lift: join no lower than those waiting, so idle time banks no credit.
            lowest = min((self._keys[k].counter for k in self._active), default=self._floor)
            state.counter = max(state.counter, lowest)
            self._active.add(key)
        entry = Entry(key, item, size_bytes, now, next(self._seq))
        state.entries.append(entry)
        state.live += 1
        self.num_requests += 1
        self.num_bytes += size_bytes
        return entry

    def pop(self) -> Entry[T] | None:
        """The next request to leave: the head of the key with the lowest counter."""
        best: _Key[T] | None = None
        best_rank = (math.inf, math.inf)
        for k in self._active:
            state = self._keys[k]
            head = self._head(state)
            rank = (state.counter, float(head.seq))
            if rank < best_rank:
                best, best_rank = state, rank
        if best is None:
            return None
        entry = best.entries.popleft()
        self._count_out(best, entry)
        self._floor = best.counter
        return entry

    def remove(self, entry: Entry[T]) -> bool:
        """Take out a request that leaves before its turn; False if it already left."""
        if entry.gone:
            return False
        state = self._keys[entry.key]
        self._count_out(state, entry)
        if len(state.entries) > 2 * state.live + 16:
            state.entries = deque(e for e in state.entries if not e.gone)
        return True

    def charge(self, key: str, tokens: float) -> None:
        """Count ``tokens`` served to ``key`` (prompt at dispatch, completion at the end)."""
        state = self._keys.get(key)
        if state is not None and tokens > 0:
            state.counter += tokens / state.weight

    def counter(self, key: str) -> float:
        state = self._keys.get(key)
        return state.counter if state is not None else self._floor

    def queued(self, key: str) -> int:
        state = self._keys.get(key)
        return state.live if state is not None else 0

    def keys(self) -> Iterator[str]:
        """Keys with requests waiting."""
        return iter(sorted(self._active))

    def oldest(self) -> float | None:
        """When the longest-waiting request was queued (None: none waits)."""
        heads = [self._head(self._keys[k]).enqueued_at for k in self._active]
        return min(heads) if heads else None

    def forget_idle(self) -> None:
        """Drop the state of keys with nothing queued and a counter at or below the floor
        (they would rejoin at the floor anyway): bounds memory by the keys seen recently."""
        for k in [k for k, s in self._keys.items() if s.live == 0 and s.counter <= self._floor]:
            del self._keys[k]

    def _head(self, state: _Key[T]) -> Entry[T]:
        entries = state.entries
        while entries[0].gone:
            entries.popleft()
        return entries[0]

    def _count_out(self, state: _Key[T], entry: Entry[T]) -> None:
        entry.gone = True
        state.live -= 1
        self.num_requests -= 1
        self.num_bytes -= entry.size_bytes
        if state.live == 0:
            self._active.discard(entry.key)
            state.entries.clear()


class DrainRate:
    """Requests leaving a queue per second: the count in the current window of
    ``window_s``, blended into a moving average as each window closes."""

    def __init__(self, *, window_s: float = 1.0, weight: float = 0.5) -> None:
        self.window_s = window_s
        self.weight = weight
        self.per_s = 0.0
        self._count = 0
        self._window_start: float | None = None

    def record(self, now: float, n: int = 1) -> None:
        self._roll(now)
        self._count += n

    def rate(self, now: float) -> float:
        self._roll(now)
        return self.per_s

    def retry_after_s(self, queued: int, now: float, *, floor_s: float, ceiling_s: float) -> float:
        """How long until ``queued`` requests have left at the current rate, within bounds:
        the time a shed client should wait before it finds room."""
        rate = self.rate(now)
        if rate <= 0:
            return ceiling_s
        return min(ceiling_s, max(floor_s, queued / rate))

    def _roll(self, now: float) -> None:
        if self._window_start is None:
            self._window_start = now
            return
        elapsed = now - self._window_start
        if elapsed < self.window_s:
            return
        windows = int(elapsed // self.window_s)
        current = self._count / self.window_s
        self.per_s += self.weight * (current - self.per_s)
        # Windows that closed empty pull the average toward zero: a stalled fleet's rate
        # decays instead of promising room that is not coming.
        self.per_s *= (1 - self.weight) ** (windows - 1)
        self._count = 0
        self._window_start += windows * self.window_s
