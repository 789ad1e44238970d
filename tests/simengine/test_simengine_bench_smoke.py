"""bench/simengine.py still runs end to end (tiny sizes: this checks it cannot rot, not speed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCH = Path(__file__).resolve().parents[2] / "bench" / "simengine.py"


def test_bench_reports_cpu_per_streamed_token_and_its_baseline() -> None:
    spec = importlib.util.spec_from_file_location("bench_simengine", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(
        ["--concurrency", "4", "--max-tokens", "5", "--prompt-words", "8", "--time-scale", "0.05"]
    )
    streamed = result["streamed"]
    assert streamed["requests"] == 4 and streamed["tokens"] == 20
    assert streamed["cpu_us_per_token"] > 0 and result["baseline_non_streamed"]["tokens"] == 20
    assert result["ratio_to_target"] == pytest.approx(streamed["cpu_us_per_token"] / 50.0, rel=1e-2)
