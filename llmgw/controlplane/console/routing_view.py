"""Pure: what the Routing page and the hit-rate chart show, from the gateway's own metrics.

A ``Snapshot`` is read from Prometheus samples (``(name, labels, value)``, as
``registry.collect()`` or the text parser give them): the routing decisions by method and
outcome, the matched-block share, time to first token, the tokenizer mode and each
replica's admitted requests and admission limit. ``step`` turns two snapshots into one row
of the console's ring: rates and shares over the interval between them, so the charts show
what happened in each 10 s, not a lifetime average that no longer moves.

Bounds: at most ``MAX_MODELS`` models (the busiest) and ``MAX_REPLICAS`` replicas are kept;
the rest are counted in ``Snapshot.more_models`` / ``more_replicas``. Label values come
from the fleet (the gateway counts unknown models under one name), never from clients.

What it must NOT do: read clocks, do I/O, or import prometheus_client (the shell does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw.controlplane.console.ring import Ring, SeriesKey

__all__ = [
    "MAX_MODELS",
    "MAX_REPLICAS",
    "MODES",
    "Snapshot",
    "charts",
    "hit_rate_chart",
    "quantile",
    "read_snapshot",
    "step",
    "table",
]

MAX_MODELS = 16
MAX_REPLICAS = 64
# How prompts are tokenized for precise routing. Absent or unknown reads as "remote": the
# engine's own /tokenize, which is what the gateway did before it said so.
MODES = ("local", "remote", "none")
_DEFAULT_MODE = "remote"

Sample = tuple[str, Mapping[str, str], float]


@dataclass(slots=True)
class Snapshot:
    decisions: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # model -> (sum of shares, count of decisions with a share)
    matched: dict[str, tuple[float, float]] = field(default_factory=dict)
    # model -> {upper bound: cumulative count}, summed over the model's replicas
    ttft: dict[str, dict[float, float]] = field(default_factory=dict)
    modes: dict[str, str] = field(default_factory=dict)
    in_flight: dict[str, float] = field(default_factory=dict)
    limit: dict[str, float] = field(default_factory=dict)
    replica_model: dict[str, str] = field(default_factory=dict)
    more_models: int = 0
    more_replicas: int = 0

    def models(self) -> list[str]:
        names = {m for m, _, _ in self.decisions} | set(self.matched) | set(self.ttft)
        return sorted(names | set(self.modes))

    def replicas(self) -> list[str]:
        return sorted(set(self.in_flight) | set(self.limit))


def read_snapshot(samples: Iterable[Sample]) -> Snapshot:
    s = Snapshot()
    matched_sum: dict[str, float] = {}
    matched_count: dict[str, float] = {}
    for name, labels, value in samples:
        model = labels.get("model", "")
        if name == "llmgw_prefix_decisions_total":
            key = (model, labels.get("method", ""), labels.get("outcome", ""))
            s.decisions[key] = s.decisions.get(key, 0.0) + value
        elif name == "llmgw_prefix_matched_share_sum":
            matched_sum[model] = matched_sum.get(model, 0.0) + value
        elif name == "llmgw_prefix_matched_share_count":
            matched_count[model] = matched_count.get(model, 0.0) + value
        elif name == "llmgw_gateway_ttft_seconds_bucket":
            le = _float(labels.get("le"))
            if le is not None:
                row = s.ttft.setdefault(model, {})
                row[le] = row.get(le, 0.0) + value
        elif name == "llmgw_prefix_tokenizer_mode":
            if value >= 1 and labels.get("mode") in MODES:
                s.modes[model] = labels["mode"]
        elif name == "llmgw_gateway_admitted_in_flight":
            s.in_flight[labels.get("replica", "")] = value
        elif name == "llmgw_gateway_admission_limit":
            s.limit[labels.get("replica", "")] = value
        elif name == "llmgw_gateway_requests_total":
            replica = labels.get("replica", "")
            if replica and model:
                s.replica_model[replica] = model
    for model in matched_count.keys() | matched_sum.keys():
        s.matched[model] = (matched_sum.get(model, 0.0), matched_count.get(model, 0.0))
    _bound(s)
    return s


def _bound(s: Snapshot) -> None:
    totals: dict[str, float] = {}
    for (model, _, _), v in s.decisions.items():
        totals[model] = totals.get(model, 0.0) + v
    models = s.models()
    if len(models) > MAX_MODELS:
        keep = set(sorted(models, key=lambda m: (-totals.get(m, 0.0), m))[:MAX_MODELS])
        s.more_models = len(models) - MAX_MODELS
        s.decisions = {k: v for k, v in s.decisions.items() if k[0] in keep}
        s.matched = {m: v for m, v in s.matched.items() if m in keep}
        s.ttft = {m: v for m, v in s.ttft.items() if m in keep}
        s.modes = {m: v for m, v in s.modes.items() if m in keep}
    replicas = s.replicas()
    if len(replicas) > MAX_REPLICAS:
        # The most loaded are the ones worth watching.
        keep = set(sorted(replicas, key=lambda r: (-s.in_flight.get(r, 0.0), r))[:MAX_REPLICAS])
        s.more_replicas = len(replicas) - MAX_REPLICAS
        s.in_flight = {r: v for r, v in s.in_flight.items() if r in keep}
        s.limit = {r: v for r, v in s.limit.items() if r in keep}
    s.replica_model = {r: m for r, m in s.replica_model.items() if r in s.replicas()}


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of a histogram's cumulative buckets, interpolated linearly within a
    bucket as Prometheus' histogram_quantile does; None without observations. A quantile in
    the +Inf bucket is the largest finite bound (it is at least that)."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def step(prev: Snapshot | None, cur: Snapshot, dt_s: float) -> dict[SeriesKey, float | None]:
    """One ring row: what happened between ``prev`` and ``cur``, ``dt_s`` apart. Without a
    previous snapshot (the first sample after a start) only the gauges have values. A counter
    that went down was reset (a restart of what counts): its interval is None, not negative."""
    row: dict[SeriesKey, float | None] = {}
    for replica in cur.replicas():
        row[("in_flight", replica)] = cur.in_flight.get(replica)
        row[("limit", replica)] = cur.limit.get(replica)
    if prev is None or dt_s <= 0:
        return row
    for model in cur.models():
        hits = decided = 0.0
        reset = False
        for key, v in cur.decisions.items():
            if key[0] != model:
                continue
            d = v - prev.decisions.get(key, 0.0)
            if d < 0:
                reset = True
                row[("decisions", *key)] = None
                continue
            row[("decisions", *key)] = round(d / dt_s, 4)
            decided += d
            if key[2] == "hit":
                hits += d
        row[("hit_rate", model)] = None if reset or decided <= 0 else round(hits / decided, 4)
        s1, c1 = cur.matched.get(model, (0.0, 0.0))
        s0, c0 = prev.matched.get(model, (0.0, 0.0))
        dc = c1 - c0
        row[("matched", model)] = round((s1 - s0) / dc, 4) if dc > 0 and s1 >= s0 else None
        b1, b0 = cur.ttft.get(model, {}), prev.ttft.get(model, {})
        delta = {le: n - b0.get(le, 0.0) for le, n in b1.items()}
        ok = all(v >= 0 for v in delta.values())
        for q, name in ((0.5, "ttft_p50"), (0.9, "ttft_p90")):
            got = quantile(q, delta) if ok else None
            row[(name, model)] = round(got, 4) if got is not None else None
    return row


def table(s: Snapshot) -> dict[str, Any]:
    """The Routing page's tables: per model its totals since this process started, and each
    replica's load now."""
    models = []
    for model in s.models():
        by: dict[tuple[str, str], float] = {}
        for (m, method, outcome), v in s.decisions.items():
            if m == model and v > 0:
                by[(method, outcome)] = v
        total = sum(by.values())
        hits = sum(v for (_, outcome), v in by.items() if outcome == "hit")
        msum, mcount = s.matched.get(model, (0.0, 0.0))
        ttft = s.ttft.get(model, {})
        models.append(
            {
                "model": model,
                "decisions": int(total),
                "by": [
                    {"method": k[0], "outcome": k[1], "count": int(v)}
                    for k, v in sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))
                ],
                "hit_rate": round(hits / total, 4) if total else None,
                "matched_share": round(msum / mcount, 4) if mcount else None,
                "ttft_p50": quantile(0.5, ttft),
                "ttft_p90": quantile(0.9, ttft),
                "mode": s.modes.get(model, _DEFAULT_MODE),
                "mode_reported": model in s.modes,
            }
        )
    replicas = [
        {
            "replica": r,
            "model": s.replica_model.get(r, ""),
            "in_flight": int(s.in_flight.get(r, 0.0)),
            "limit": s.limit.get(r),
        }
        for r in s.replicas()
    ]
    return {
        "models": models,
        "replicas": replicas,
        "more_models": s.more_models,
        "more_replicas": s.more_replicas,
    }


def _chart(
    chart_id: str, title: str, unit: str, times: list[float], series: list[tuple[str, Any]]
) -> dict[str, Any]:
    return {
        "id": chart_id,
        "title": title,
        "unit": unit,
        "times": times,
        "series": [
            {"label": label, "values": values} for label, values in series if values is not None
        ],
    }


def hit_rate_chart(ring: Ring) -> dict[str, Any]:
    """The overview's chart: the share of each model's decisions that hit, per interval."""
    keys = [k for k in ring.series_keys() if k[0] == "hit_rate"]
    return _chart(
        "hit-rate", "Prefix hit rate per model", "ratio", ring.times(),
        [(k[1], ring.series(k)) for k in keys],
    )  # fmt: skip


def charts(ring: Ring) -> list[dict[str, Any]]:
    """The Routing page's charts: per model decisions by method and outcome, matched-block
    share, TTFT p50/p90; then every replica's admitted requests."""
    times = ring.times()
    keys = ring.series_keys()
    models = sorted({k[1] for k in keys if k[0] != "in_flight" and k[0] != "limit"})
    out = []
    for model in models:
        decisions = [k for k in keys if k[0] == "decisions" and k[1] == model]
        out.append(
            _chart(
                f"decisions:{model}",
                f"{model}: decisions per second by method and outcome",
                "rate",
                times,
                [(f"{k[2]} {k[3]}", ring.series(k)) for k in decisions],
            )
        )
        out.append(
            _chart(
                f"matched:{model}",
                f"{model}: matched-block share",
                "ratio",
                times,
                [("matched share", ring.series(("matched", model)))],
            )
        )
        out.append(
            _chart(
                f"ttft:{model}",
                f"{model}: time to first token",
                "seconds",
                times,
                [
                    ("p50", ring.series(("ttft_p50", model))),
                    ("p90", ring.series(("ttft_p90", model))),
                ],
            )
        )
    replicas = [k[1] for k in keys if k[0] == "in_flight"]
    out.append(
        _chart(
            "load",
            "Requests in flight per replica (this gateway's)",
            "count",
            times,
            [(r[:8], ring.series(("in_flight", r))) for r in replicas],
        )
    )
    return out


def _float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None
