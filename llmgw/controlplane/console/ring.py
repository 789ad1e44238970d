"""Pure: a bounded ring of time series, one point per sample, all series on one time axis.

The console's charts over the last hour come from here: the control plane samples its own
gateway every ``interval_s`` and appends one row. Memory is bounded twice: at most
``capacity`` rows (1 h at 10 s is 360) and at most ``max_series`` series (a series first seen
past that is refused and counted in ``refused``, never grown). A series that held only
``None`` over the whole window is forgotten, so replicas and models that went away leave.

A sample that comes late (the loop stalled, the process was busy) is preceded by one row of
``None``: a chart draws a gap there instead of a straight line across the silence. A restart
starts an empty ring: the chart begins at the restart, which is a gap, not an error.

What it must NOT do: read clocks (``at`` is passed) or know what the series mean.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

__all__ = ["Ring", "SeriesKey"]

SeriesKey = tuple[str, ...]


class Ring:
    def __init__(self, *, capacity: int, interval_s: float, max_series: int) -> None:
        if capacity < 2 or interval_s <= 0 or max_series < 1:
            raise ValueError("a ring needs capacity >= 2, interval_s > 0 and max_series >= 1")
        self.capacity = capacity
        self.interval_s = interval_s
        self.max_series = max_series
        self.refused = 0
        self._times: deque[float] = deque(maxlen=capacity)
        self._series: dict[SeriesKey, deque[float | None]] = {}

    def add(self, at: float, values: Mapping[SeriesKey, float | None]) -> None:
        """Append the row sampled at ``at``; a series missing from ``values`` gets ``None``."""
        if self._times and at <= self._times[-1]:
            return  # a clock step backwards: keep the axis increasing
        if self._times and at - self._times[-1] > 2 * self.interval_s:
            self._append(self._times[-1] + self.interval_s, {})
        self._append(at, values)
        self._forget_empty()

    def times(self) -> list[float]:
        return list(self._times)

    def series(self, key: SeriesKey) -> list[float | None] | None:
        s = self._series.get(key)
        return list(s) if s is not None else None

    def series_keys(self) -> list[SeriesKey]:
        return sorted(self._series)

    def last(self, key: SeriesKey) -> float | None:
        s = self._series.get(key)
        return s[-1] if s else None

    def __len__(self) -> int:
        return len(self._times)

    def _append(self, at: float, values: Mapping[SeriesKey, float | None]) -> None:
        for key, value in values.items():
            # A series starts at its first value: None alone does not make one.
            if key not in self._series and value is not None:
                if len(self._series) >= self.max_series:
                    self.refused += 1
                    continue
                # Backfilled with None: the series did not exist at the earlier rows.
                self._series[key] = deque([None] * len(self._times), maxlen=self.capacity)
        self._times.append(at)
        for key, s in self._series.items():
            s.append(values.get(key))

    def _forget_empty(self) -> None:
        if len(self._times) < self.capacity:
            return
        for key in [k for k, s in self._series.items() if all(v is None for v in s)]:
            del self._series[key]
