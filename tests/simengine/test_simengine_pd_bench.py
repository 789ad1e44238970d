"""bench/pd.py still runs (tiny sizes: this checks the hand-off and the accounting, not speed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench" / "pd.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_pd", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_pd"] = module  # dataclasses resolve their module's annotations here
    spec.loader.exec_module(module)
    return module


def test_disaggregated_requests_load_their_prompt_and_every_arm_serves_all() -> None:
    bench = _bench()
    out = bench.main(
        [
            *("--rate", "4", "--sweep-rates", "--duration-s", "4", "--warmup-s", "0"),
            *("--json", "", "--png", ""),
        ]
    )
    arms = out["headline"]["arms"]
    assert set(arms) == {"aggregated", "2P:6D", "4P:4D"}
    n = arms["aggregated"]["requests"]
    assert n > 5 and all(a["requests"] == n for a in arms.values())
    assert arms["4P:4D"]["vs_aggregated"]["goodput"] is not None
    assert set(out["target"]["2P:6D"]) >= {"itl_p90_ratio", "ttft_p90_ratio", "goodput_ratio"}


def test_a_decode_replica_computes_only_the_prompt_tail() -> None:
    bench = _bench()
    from llmgw.simengine.scheduler import SchedulerConfig
    from llmgw.simengine.timing import TimingModel

    reqs = [bench.Request(0.0, tuple(range(1, 1001)), 3, True)]
    # Prefill compute is free and loads are slow: the decode's first token then waits only for
    # the load of 992 tokens (62 blocks) and one step of the 8-token tail.
    timing = TimingModel(step_overhead_ms=0, prefill_ms_per_token=0, decode_ms_per_seq=0,
                         kv_load_ms_per_token=1.0)  # fmt: skip
    outcome = bench.simulate(
        reqs, prefill=1, decode=1, config=SchedulerConfig(), timing=timing, warmup_s=0
    )
    assert outcome.ttft_s == [0.992]
    agg = bench.simulate(
        reqs, prefill=0, decode=1, config=SchedulerConfig(), timing=timing, warmup_s=0
    )
    assert agg.ttft_s == [0.0]  # aggregated loads nothing
