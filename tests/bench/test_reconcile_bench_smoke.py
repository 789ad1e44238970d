"""bench/reconcile_plan.py still runs end to end (tiny fleets: this checks it cannot rot, not speed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "reconcile_plan.py"


def test_bench_reports_plan_times_per_fleet_size() -> None:
    spec = importlib.util.spec_from_file_location("bench_reconcile_plan", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--sizes", "20", "40", "--reps", "1", "--initial-max", "20"])
    small, large = result["fleets"]
    assert (small["nodes"], large["nodes"]) == (20, 40)
    assert small["replicas"] == 12 and large["replicas"] == 26
    assert small["initial_replicas_created"] == 12 and "initial_ms" not in large
    assert large["one_rollout_actions"] == {"CreateReplica": 1, "UpdateRolloutStatus": 1}
    assert result["noop_growth_vs_linear"] > 0
