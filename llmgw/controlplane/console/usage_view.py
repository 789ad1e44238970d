"""Pure: usage per key and model per day, as the Keys and usage page charts it and as CSV.

Input is the admin API's ``GET /usage?group=day`` items (``key``, ``model``, ``start``,
``requests``, token counts). The chart has one series per key and model, tokens per UTC day
over the last ``days`` days, every day present (0 where nothing was used, so a line does not
jump over idle days); at most ``MAX_SERIES`` series, the busiest, the rest summed as "other".

The CSV is RFC 4180 (``csv`` quotes what needs it). A cell starting with ``= + - @`` or a tab
or CR is prefixed with ``'``: a key named ``=HYPERLINK(...)`` must not become a formula in
the spreadsheet an operator opens the export in.

What it must NOT do: read clocks (``today`` is passed) or do I/O.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping
from datetime import date, datetime, timedelta
from typing import Any

__all__ = ["CSV_COLUMNS", "MAX_SERIES", "daily_chart", "usage_csv"]

MAX_SERIES = 12
CSV_COLUMNS = (
    "day", "key", "key_id", "model", "requests", "prompt_tokens", "cached_tokens",
    "completion_tokens", "total_tokens",
)  # fmt: skip
_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def _day(value: Any) -> date | None:
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date):
        return value
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).date()
        except ValueError:
            return None
    return None


def _tokens(row: Mapping[str, Any]) -> int:
    total = row.get("total_tokens")
    if total is None:
        total = int(row.get("prompt_tokens") or 0) + int(row.get("completion_tokens") or 0)
    return int(total)


def daily_chart(rows: Iterable[Mapping[str, Any]], *, today: date, days: int) -> dict[str, Any]:
    """A chart (the console's chart JSON): x is each day's midnight UTC in epoch seconds."""
    first = today - timedelta(days=days - 1)
    axis = [first + timedelta(days=i) for i in range(days)]
    index = {d: i for i, d in enumerate(axis)}
    per: dict[str, list[float]] = {}
    for row in rows:
        d = _day(row.get("start"))
        if d is None or d not in index:
            continue
        label = f"{row.get('key', '?')} · {row.get('model', '?')}"
        per.setdefault(label, [0.0] * days)[index[d]] += _tokens(row)
    ranked = sorted(per.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    shown = ranked[:MAX_SERIES]
    if len(ranked) > MAX_SERIES:
        other = [0.0] * days
        for _, values in ranked[MAX_SERIES:]:
            other = [a + b for a, b in zip(other, values, strict=True)]
        shown.append((f"other ({len(ranked) - MAX_SERIES} keys and models)", other))
    return {
        "id": "usage-daily",
        "title": "Tokens per day per key and model",
        "unit": "count",
        "kind": "bars",
        "times": [(d - date(1970, 1, 1)).total_seconds() for d in axis],
        "series": [{"label": label, "values": values} for label, values in shown],
    }


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(_FORMULA) else text


def usage_csv(rows: Iterable[Mapping[str, Any]]) -> str:
    """The rows as CSV with a header, one line per key, model and day."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\r\n")
    w.writerow(CSV_COLUMNS)
    for row in rows:
        d = _day(row.get("start"))
        w.writerow(
            [
                _cell(d.isoformat() if d else row.get("start")),
                _cell(row.get("key")),
                _cell(row.get("key_id")),
                _cell(row.get("model")),
                int(row.get("requests") or 0),
                int(row.get("prompt_tokens") or 0),
                int(row.get("cached_tokens") or 0),
                int(row.get("completion_tokens") or 0),
                _tokens(row),
            ]
        )
    return out.getvalue()
