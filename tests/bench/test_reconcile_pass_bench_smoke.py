"""bench/reconcile.py still runs end to end (tiny fleets: this checks it cannot rot, not speed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "reconcile.py"

pytestmark = pytest.mark.timeout(180)


def test_bench_reports_pass_load_and_plan_per_fleet_size() -> None:
    spec = importlib.util.spec_from_file_location("bench_reconcile_pass", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--sizes", "10", "20", "--reps", "1"])
    small, large = result["fleets"]
    assert (small["nodes"], large["nodes"]) == (10, 20)
    assert small["replicas_placed"] == small["replicas"] == 7
    assert result["statements_constant"] and small["statements_per_pass"][0] > 0
    for key in ("pass_ms_best", "load_ms_best", "load_cold_ms_best", "plan_ms_best"):
        assert large[key] > 0, key
