"""The console's chart cores: the ring (bounded rows and series, gaps, forgetting), the
routing view (metrics samples -> snapshot -> one ring row: rates, shares, TTFT quantiles,
resets, the tokenizer mode, the bounds on models and replicas) and the usage export (the
per-day chart, CSV quoting and formula cells)."""

from __future__ import annotations

import csv
import io
from datetime import date

import pytest
from prometheus_client import CollectorRegistry

from llmgw.controlplane.console import routing_view as rv
from llmgw.controlplane.console.ring import Ring
from llmgw.controlplane.console.sampler import RoutingSampler
from llmgw.controlplane.console.usage_view import MAX_SERIES, daily_chart, usage_csv
from llmgw.gateway.metrics import GatewayMetrics

# --- the ring -----------------------------------------------------------------------------


def test_the_ring_keeps_capacity_rows_aligned_and_backfills_new_series() -> None:
    ring = Ring(capacity=3, interval_s=10, max_series=10)
    ring.add(0, {("a",): 1.0})
    ring.add(10, {("a",): 2.0, ("b",): 5.0})
    assert ring.series(("b",)) == [None, 5.0]  # it did not exist at the first row
    ring.add(20, {("a",): 3.0})
    ring.add(30, {("a",): 4.0})
    assert ring.times() == [10, 20, 30]
    assert ring.series(("a",)) == [2.0, 3.0, 4.0]
    assert ring.series(("b",)) == [5.0, None, None]
    assert ring.last(("a",)) == 4.0 and ring.last(("zz",)) is None
    ring.add(25, {("a",): 9.0})  # the clock stepped back: ignored
    assert ring.times() == [10, 20, 30]


def test_a_late_sample_leaves_a_gap_and_empty_series_are_forgotten() -> None:
    ring = Ring(capacity=4, interval_s=10, max_series=10)
    ring.add(0, {("a",): 1.0, ("b",): 1.0})
    ring.add(65, {("a",): 2.0})  # a restart or a stall: one row of None before it
    assert ring.times() == [0, 10, 65]
    assert ring.series(("a",)) == [1.0, None, 2.0]
    ring.add(75, {("a",): 3.0})
    ring.add(85, {("a",): 4.0})
    # b held only None over the whole (full) window: gone.
    assert ring.series_keys() == [("a",)]
    ring.add(95, {("c",): None})  # None alone does not start a series
    assert ring.series_keys() == [("a",)]


def test_the_ring_refuses_series_past_its_bound() -> None:
    ring = Ring(capacity=10, interval_s=1, max_series=2)
    ring.add(0, {("a",): 1.0, ("b",): 1.0, ("c",): 1.0})
    assert len(ring.series_keys()) == 2 and ring.refused == 1
    with pytest.raises(ValueError):
        Ring(capacity=1, interval_s=1, max_series=1)


# --- the routing view ---------------------------------------------------------------------


def _samples(
    decisions: dict[tuple[str, str, str], float],
    ttft: dict[float, float] | None = None,
    **gauges: dict[str, float],
) -> list[tuple[str, dict[str, str], float]]:
    out: list[tuple[str, dict[str, str], float]] = []
    for (model, method, outcome), v in decisions.items():
        out.append(
            (
                "llmgw_prefix_decisions_total",
                {"model": model, "method": method, "outcome": outcome},
                v,
            )
        )
    for le, n in (ttft or {}).items():
        labels = {"model": "m", "replica": "r1", "le": str(le)}
        out.append(("llmgw_gateway_ttft_seconds_bucket", labels, n))
    for replica, v in gauges.get("in_flight", {}).items():
        out.append(("llmgw_gateway_admitted_in_flight", {"replica": replica}, v))
    for replica, v in gauges.get("limit", {}).items():
        out.append(("llmgw_gateway_admission_limit", {"replica": replica}, v))
    return out


def test_quantile_interpolates_within_buckets_like_prometheus() -> None:
    buckets = {0.1: 0.0, 0.5: 10.0, 1.0: 20.0, float("inf"): 20.0}
    assert rv.quantile(0.5, buckets) == pytest.approx(0.5)
    assert rv.quantile(0.25, buckets) == pytest.approx(0.3)
    assert rv.quantile(0.9, buckets) == pytest.approx(0.9)
    assert rv.quantile(0.5, {1.0: 0.0, float("inf"): 4.0}) == 1.0  # in +Inf: its lower bound
    assert rv.quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None
    assert rv.quantile(0.5, {}) is None


def test_a_step_is_rates_and_shares_over_the_interval_not_since_the_start() -> None:
    a = rv.read_snapshot(
        _samples(
            {("m", "precise", "hit"): 100, ("m", "precise", "miss"): 100},
            {0.1: 0, 0.5: 0, float("inf"): 0},
            in_flight={"r1": 2},
            limit={"r1": 8},
        )
    )
    b = rv.read_snapshot(
        _samples(
            {("m", "precise", "hit"): 118, ("m", "precise", "miss"): 102},
            {0.1: 5, 0.5: 10, float("inf"): 10},
            in_flight={"r1": 3},
            limit={"r1": 4},
        )
    )
    first = rv.step(None, a, 0)
    assert first == {("in_flight", "r1"): 2, ("limit", "r1"): 8}  # gauges only
    row = rv.step(a, b, 10)
    assert row[("hit_rate", "m")] == 0.9  # 18 of 20 in the interval (the lifetime says 54%)
    assert row[("decisions", "m", "precise", "hit")] == 1.8
    assert row[("decisions", "m", "precise", "miss")] == 0.2
    assert row[("ttft_p50", "m")] == pytest.approx(0.1)
    assert row[("ttft_p90", "m")] == pytest.approx(0.42)
    assert row[("in_flight", "r1")] == 3 and row[("limit", "r1")] == 4
    assert row[("matched", "m")] is None  # no shares observed
    # A counter went down (what counts restarted): that interval is None, not negative.
    reset = rv.step(b, a, 10)
    assert reset[("hit_rate", "m")] is None and reset[("decisions", "m", "precise", "hit")] is None
    assert reset[("ttft_p50", "m")] is None


def test_the_tokenizer_mode_is_read_and_assumed_remote_when_absent() -> None:
    samples = _samples({("a", "precise", "hit"): 1, ("b", "precise", "hit"): 1})
    samples.append(("llmgw_prefix_tokenizer_mode", {"model": "a", "mode": "remote"}, 0.0))
    samples.append(("llmgw_prefix_tokenizer_mode", {"model": "a", "mode": "local"}, 1.0))
    samples.append(("llmgw_prefix_tokenizer_mode", {"model": "b", "mode": "bogus"}, 1.0))
    got = {
        m["model"]: (m["mode"], m["mode_reported"])
        for m in rv.table(rv.read_snapshot(samples))["models"]
    }
    assert got == {"a": ("local", True), "b": ("remote", False)}


def test_models_and_replicas_are_bounded_keeping_the_busiest() -> None:
    decisions = {(f"m{i:02d}", "precise", "hit"): float(i) for i in range(rv.MAX_MODELS + 4)}
    in_flight = {f"r{i:03d}": float(i) for i in range(rv.MAX_REPLICAS + 6)}
    s = rv.read_snapshot(_samples(decisions, in_flight=in_flight))
    assert len(s.models()) == rv.MAX_MODELS and s.more_models == 4
    assert "m00" not in s.models() and f"m{rv.MAX_MODELS + 3:02d}" in s.models()
    assert len(s.replicas()) == rv.MAX_REPLICAS and s.more_replicas == 6
    assert "r000" not in s.replicas()


def test_the_sampler_reads_the_gateways_own_registry_in_process() -> None:
    registry = CollectorRegistry()
    m = GatewayMetrics.create(registry)
    sampler = RoutingSampler(registry, interval_s=10, capacity=360)
    m.inc(m.decisions, "demo", "precise", "miss")
    m.gauge(m.admitted_in_flight, 1, "rep-1")
    m.gauge(m.admission_limit, 16, "rep-1")
    sampler.sample(1000.0)
    for _ in range(3):
        m.inc(m.decisions, "demo", "precise", "hit")
    m.inc(m.decisions, "demo", "precise", "miss")
    m.observe(m.matched_share, 0.75, "demo", "precise")
    m.observe(m.ttft_seconds, 0.02, "demo", "rep-1")
    m.inc(m.requests, "demo", "rep-1", "200")
    sampler.sample(1010.0)
    ring = sampler.ring
    assert ring.times() == [1000.0, 1010.0]
    assert ring.series(("hit_rate", "demo")) == [None, 0.75]
    assert ring.series(("matched", "demo")) == [None, 0.75]
    assert ring.series(("in_flight", "rep-1")) == [1, 1]
    hit = rv.hit_rate_chart(ring)
    assert hit["series"] == [{"label": "demo", "values": [None, 0.75]}]
    ids = [c["id"] for c in rv.charts(ring)]
    assert ids == ["decisions:demo", "matched:demo", "ttft:demo", "load"]
    (row,) = rv.table(sampler.read())["replicas"]
    assert row == {"replica": "rep-1", "model": "demo", "in_flight": 1, "limit": 16}
    assert RoutingSampler(None).read().models() == []  # no registry: nothing, no error


# --- usage --------------------------------------------------------------------------------


def _usage(key: str, model: str, day: str, prompt: int, completion: int) -> dict[str, object]:
    return {
        "key": key, "key_id": f"id-{key}", "model": model, "start": f"{day}T00:00:00Z",
        "requests": 1, "prompt_tokens": prompt, "cached_tokens": 0,
        "completion_tokens": completion, "total_tokens": prompt + completion,
    }  # fmt: skip


def test_the_daily_chart_has_every_day_and_bounds_its_series() -> None:
    rows = [
        _usage("k1", "m", "2026-01-10", 10, 5),
        _usage("k1", "m", "2026-01-08", 1, 1),
        _usage("k2", "m", "2025-12-01", 100, 0),  # outside the window
    ]
    chart = daily_chart(rows, today=date(2026, 1, 10), days=3)
    assert len(chart["times"]) == 3 and chart["times"][-1] - chart["times"][0] == 2 * 86400
    assert chart["series"] == [{"label": "k1 · m", "values": [2.0, 0.0, 15.0]}]
    many = [_usage(f"k{i:02d}", "m", "2026-01-10", i + 1, 0) for i in range(MAX_SERIES + 3)]
    chart = daily_chart(many, today=date(2026, 1, 10), days=1)
    assert len(chart["series"]) == MAX_SERIES + 1
    assert chart["series"][0]["label"] == f"k{MAX_SERIES + 2:02d} · m"  # busiest first
    assert chart["series"][-1] == {"label": "other (3 keys and models)", "values": [6.0]}


def test_the_csv_is_quoted_and_never_a_formula() -> None:
    rows = [
        _usage("team,a", 'm "x"', "2026-01-10", 10, 5),
        _usage("=HYPERLINK(1)", "@m", "2026-01-09", 1, 0),
    ]
    text = usage_csv(rows)
    assert text.endswith("\r\n")
    parsed = list(csv.reader(io.StringIO(text)))
    assert parsed[0][:4] == ["day", "key", "key_id", "model"]
    assert parsed[1] == ["2026-01-10", "team,a", "id-team,a", 'm "x"', "1", "10", "0", "5", "15"]
    assert parsed[2][1] == "'=HYPERLINK(1)" and parsed[2][3] == "'@m"
    assert usage_csv([]) == ",".join(parsed[0]) + "\r\n"


async def test_the_sampler_loop_reads_off_the_loop_and_stops_when_told() -> None:
    import asyncio

    registry = CollectorRegistry()
    m = GatewayMetrics.create(registry)
    m.gauge(m.admitted_in_flight, 2, "rep-1")
    sampler = RoutingSampler(registry, interval_s=0.05)
    two_rows = asyncio.Event()
    sample = sampler.sample
    samples = 0

    def counted(now: float, cur: rv.Snapshot | None = None) -> None:
        nonlocal samples
        sample(now, cur)
        samples += 1
        if samples >= 2:
            two_rows.set()

    sampler.sample = counted  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(sampler.run(stop))
    async with asyncio.timeout(5):
        await two_rows.wait()
    stop.set()
    async with asyncio.timeout(5):
        await task
    # A loaded host may space two samples past twice the interval: the ring then holds a gap
    # row (None) between them, by design. The samples themselves each read the gauge.
    series = sampler.ring.series(("in_flight", "rep-1"))
    assert series is not None
    assert [v for v in series if v is not None][:2] == [2, 2]


# --- the wire -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "gzip_ok"),
    [
        ("gzip, deflate, br", True),
        ("br;q=1.0, GZIP;q=0.5", True),
        ("*", True),
        ("gzip;q=0", False),
        ("gzip;q=0.0, *;q=1", False),  # named and refused: the wildcard does not override it
        ("identity", False),
        ("", False),
        ("gzip;q=nonsense", False),
    ],
)
def test_gzip_is_sent_only_to_a_client_that_accepts_it(header: str, gzip_ok: bool) -> None:
    from llmgw.controlplane.console.wire import accepts_gzip

    assert accepts_gzip(header) is gzip_ok


def test_a_full_routing_ring_shrinks_on_the_wire_and_decodes_to_the_same_charts() -> None:
    import gzip
    import json

    from llmgw.controlplane.console.wire import dumps, gzip_json

    ring = Ring(capacity=360, interval_s=10, max_series=600)
    for t in range(360):
        row: dict[tuple[str, ...], float | None] = {}
        for m in range(16):
            row[("hit_rate", f"model-{m}")] = round((t * 7 + m) % 100 / 100, 4)
            row[("ttft_p90", f"model-{m}")] = None if t % 9 == 0 else round(t / 360, 4)
        for r in range(64):
            row[("in_flight", f"{r:08x}")] = float((t + r) % 24)
        ring.add(t * 10, row)
    body = dumps({"charts": rv.charts(ring)})
    packed = gzip_json(body)
    assert len(packed) * 4 < len(body), (len(body), len(packed))
    assert json.loads(gzip.decompress(packed)) == json.loads(body)
    assert gzip_json(body) == packed  # a fixed mtime: the same body, the same bytes
    with pytest.raises(ValueError):
        dumps({"x": float("nan")})
