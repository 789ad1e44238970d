"""Benchmark: prefill/decode disaggregation against aggregated serving, at equal GPUs.

In-process and in simulated time, like bench/engine_replay.py: every replica is the
simulator's own ``Scheduler`` stepped under its ``TimingModel`` (no HTTP, no sleeping), one
replica per GPU. What is compared, on one seeded trace:

- aggregated: ``--gpus`` replicas, each prefilling and decoding; a request goes to the
  replica with the fewest unfinished requests (ties: the fewest prompt tokens not yet
  prefilled there), once;
- disaggregated ``P:D`` (``--ratios``): P prefill replicas (KV producers: ``kv_save``) and D
  decode replicas (KV consumers: ``kv_lookup``), the simulator's --kv-transfer-config in
  process. A request goes to a prefill replica with ``max_tokens`` 1, as vLLM's P/D proxy
  sends it; when that token comes, the prompt's full blocks are in the shared store and the
  request goes to a decode replica (same routing rule), which loads them at
  ``kv_load_ms_per_token`` (charged to its whole step, as the sync shared-storage connector
  stalls the batch), computes the prompt's last partial block and decodes. Its first token
  there is the client's first token (the proxy drops the prefill's), so TTFT counts both
  queues, the prefill, the hand-off and the load.

Workload: Poisson arrivals at ``--rate`` requests/s; a ``--long-share`` of them are long
prompts with short answers (3000-6000 tokens in, 20-60 out), the rest short prompts with
long answers (50-200 in, 300-600 out); no two prompts share a block (the comparison is of
placement, not of prefix caching). Requests arriving in the first ``--warmup-s`` are served
but not counted; every run drains.

Reported per arm and rate: TTFT p50/p90, inter-token latency (ITL, every gap between two
tokens of a request, pooled, as vLLM's histogram counts them) p50/p90/p99, TPOT p50/p90 (a
request's mean gap, one value per request), goodput: counted requests per second of the
counted window that met the SLO (TTFT <= ``--slo-ttft-s`` and the request's own ITL p90 <=
``--slo-itl-s``), each disaggregated figure also as a ratio to aggregated's, and the share
of the run each pool spent stepping. The headline (``--rate``): the issue's target,
disaggregated ITL p90 <= 0.6x aggregated's at equal GPUs, with TTFT and goodput beside it.
The sweep (``--sweep-rates``): where disaggregation stops paying, the rates at which its
goodput ratio to aggregated crosses 1 (linear between points).

Why pooled ITL p90 hardly moves while TPOT and ITL p99 do: with chunked prefill a step that
carries a chunk stalls its decodes (~100 ms at the default budget), but such steps are a few
percent of all steps, so they set the pooled tail (p99) and every request's mean, not its
p90. Disaggregation removes them from decode replicas and instead puts more sequences, and
each arriving request's KV load, on fewer decode replicas.

The model, stated: the simulator's cost model with its defaults (2 ms per step, 0.05 ms per
prefill token, 0.3 ms per decoding sequence, 0.005 ms per loaded token), 4096 blocks of 16
tokens and a 2048-token step budget per replica; chunked prefill stalls every decode of its
step (the cost model charges prefill to the whole step), which is what disaggregation
removes from decode replicas; the hand-off itself is instant (the load is what costs).

    # docs/bench/pd.{json,png}: the defaults, 73 s on the shared 2-core machine
    .venv/bin/python bench/pd.py
    .venv/bin/python bench/pd.py --rate 20 --sweep-rates 10 20 --duration-s 20 --png ""
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import ROOT, percentile

from llmgw.kv.hashing import BlockHash
from llmgw.simengine.kv_transfer import leading_run
from llmgw.simengine.scheduler import RequestSpec, Scheduler, SchedulerConfig
from llmgw.simengine.timing import TimingModel

__all__ = ["Request", "main", "simulate", "workload"]

LONG_IN, LONG_OUT = (3000, 6000), (20, 60)
SHORT_IN, SHORT_OUT = (50, 200), (300, 600)
# Token ids per request: prompts are disjoint runs of ids, so no two share a block.
_ID_STRIDE = 10_000


@dataclass(frozen=True, slots=True)
class Request:
    at: float
    prompt: tuple[int, ...]
    output_tokens: int
    long: bool


def workload(rate: float, duration_s: float, long_share: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    out: list[Request] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        long = rng.random() < long_share
        lo_in, hi_in = LONG_IN if long else SHORT_IN
        lo_out, hi_out = LONG_OUT if long else SHORT_OUT
        n = rng.randint(lo_in, hi_in)
        base = len(out) * _ID_STRIDE + 1
        out.append(Request(t, tuple(range(base, base + n)), rng.randint(lo_out, hi_out), long))
        t += rng.expovariate(rate)
    return out


def _hasher(parent: BlockHash | None, tokens: tuple[int, ...], index: int) -> BlockHash:
    # Only equality matters in process: a chained name per block, as the engine chains.
    return BlockHash(hash((parent, tokens)).to_bytes(8, "big", signed=True))


@dataclass(slots=True)
class _Replica:
    sched: Scheduler
    now: float = 0.0  # when its current step ends (or since when it idles)
    busy_s: float = 0.0
    unfinished: int = 0
    unprefilled: int = 0  # prompt tokens routed here and not yet past their first token

    def load(self) -> tuple[int, int]:
        return self.unfinished, self.unprefilled


@dataclass(slots=True)
class _Track:
    """One request as its client sees it."""

    arrival: float
    first: float | None = None
    last: float = 0.0
    gaps: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Outcome:
    ttft_s: list[float]
    itl_s: list[float]  # every gap, pooled
    itl_p90_per_request: list[float]
    tpot_s: list[float]  # per request: its mean gap (vLLM's TPOT)
    stepping: dict[str, float]  # pool -> mean share of the run its replicas were stepping
    makespan_s: float


def simulate(
    reqs: Sequence[Request],
    *,
    prefill: int,
    decode: int,
    config: SchedulerConfig,
    timing: TimingModel,
    warmup_s: float,
) -> Outcome:
    """``prefill`` 0: ``decode`` aggregated replicas; else P:D disaggregated."""
    store: set[BlockHash] = set()

    def lookup(hashes: Sequence[BlockHash]) -> int:
        return leading_run(hashes, store.__contains__)

    disagg = prefill > 0
    p_pool = [_Replica(Scheduler(config, kv_save=True)) for _ in range(prefill)]
    d_pool = [
        _Replica(Scheduler(config, kv_lookup=lookup if disagg else None)) for _ in range(decode)
    ]
    replicas = [*p_pool, *d_pool]  # index < prefill: a prefill replica
    tracks = [_Track(r.at) for r in reqs]
    # (time, order, request index, to the decode pool): arrivals, then hand-offs as they come.
    events = [(r.at, i, i, False) for i, r in enumerate(reqs)]
    heapq.heapify(events)
    order = len(reqs)

    while True:
        stepping = [k for k, rep in enumerate(replicas) if rep.sched.has_work()]
        nxt = min(stepping, key=lambda k: replicas[k].now) if stepping else None
        # An event at or before the next step's start joins that step, as the engine's loop
        # takes new requests between steps.
        if events and (nxt is None or events[0][0] <= replicas[nxt].now):
            at, _, i, to_decode = heapq.heappop(events)
            first_hop = disagg and not to_decode
            pool = p_pool if first_hop else d_pool
            rep = min(pool, key=_Replica.load)
            if not rep.sched.has_work():
                rep.now = max(rep.now, at)
            req = reqs[i]
            rep.sched.add_request(
                RequestSpec(
                    request_id=str(i),
                    prompt_token_ids=req.prompt,
                    # vLLM's P/D proxy sends the prefill max_tokens 1.
                    output_token_ids=(1,) if first_hop else tuple(range(1, req.output_tokens + 1)),
                    hasher=_hasher,
                )
            )
            rep.unfinished += 1
            rep.unprefilled += len(req.prompt)
            continue
        if nxt is None:
            break
        rep = replicas[nxt]
        result = rep.sched.step()
        rep.sched.take_events()  # nobody listens in process; events would pile up
        dt = timing.step_duration_s(
            result.num_prefill_tokens, result.num_decode_seqs, result.num_loaded_tokens
        )
        rep.now += dt
        rep.busy_s += dt
        for save in result.kv_saves:
            store.update(save.block_hashes)
        if nxt < prefill:
            for rid in result.finished:  # its one token: the request moves to decode
                i = int(rid)
                rep.unfinished -= 1
                rep.unprefilled -= len(reqs[i].prompt)
                heapq.heappush(events, (rep.now, order, i, True))
                order += 1
            continue
        for rid in result.emitted:
            tr = tracks[int(rid)]
            if tr.first is None:
                tr.first = rep.now
                rep.unprefilled -= len(reqs[int(rid)].prompt)
            else:
                tr.gaps.append(rep.now - tr.last)
            tr.last = rep.now
        rep.unfinished -= len(result.finished)

    counted = [t for t in tracks if t.arrival >= warmup_s]
    assert all(t.first is not None for t in counted), "a request never got its first token"
    makespan = max(r.now for r in replicas)
    pools = {"prefill": p_pool, "decode": d_pool} if disagg else {"aggregated": d_pool}
    return Outcome(
        ttft_s=[t.first - t.arrival for t in counted if t.first is not None],
        itl_s=[g for t in counted for g in t.gaps],
        itl_p90_per_request=[percentile(t.gaps, 90) if t.gaps else 0.0 for t in counted],
        tpot_s=[sum(t.gaps) / len(t.gaps) if t.gaps else 0.0 for t in counted],
        stepping={
            name: round(sum(r.busy_s for r in pool) / (len(pool) * makespan), 3)
            if makespan
            else 0.0
            for name, pool in pools.items()
        },
        makespan_s=makespan,
    )


def _ms(values: Sequence[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 1)


def report(out: Outcome, *, window_s: float, slo_ttft_s: float, slo_itl_s: float) -> dict[str, Any]:
    met = sum(
        1
        for ttft, itl in zip(out.ttft_s, out.itl_p90_per_request, strict=True)
        if ttft <= slo_ttft_s and itl <= slo_itl_s
    )
    return {
        "requests": len(out.ttft_s),
        "ttft_ms": {"p50": _ms(out.ttft_s, 50), "p90": _ms(out.ttft_s, 90)},
        "itl_ms": {"p50": _ms(out.itl_s, 50), "p90": _ms(out.itl_s, 90), "p99": _ms(out.itl_s, 99)},
        "tpot_ms": {"p50": _ms(out.tpot_s, 50), "p90": _ms(out.tpot_s, 90)},
        "goodput_rps": round(met / window_s, 3),
        "slo_attainment": round(met / max(1, len(out.ttft_s)), 3),
        "stepping_share": out.stepping,
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None  # JSON has no infinity


def ratios(arm: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    return {
        "ttft_p50": _ratio(arm["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
        "ttft_p90": _ratio(arm["ttft_ms"]["p90"], base["ttft_ms"]["p90"]),
        "itl_p50": _ratio(arm["itl_ms"]["p50"], base["itl_ms"]["p50"]),
        "itl_p90": _ratio(arm["itl_ms"]["p90"], base["itl_ms"]["p90"]),
        "itl_p99": _ratio(arm["itl_ms"]["p99"], base["itl_ms"]["p99"]),
        "tpot_p90": _ratio(arm["tpot_ms"]["p90"], base["tpot_ms"]["p90"]),
        "goodput": _ratio(arm["goodput_rps"], base["goodput_rps"]),
    }


def crossings(xs: Sequence[float], ys: Sequence[float | None], level: float = 1.0) -> list[float]:
    """Where the piecewise-linear curve through (xs, ys) crosses ``level`` (None: no point)."""
    out: list[float] = []
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if (y0 - level) * (y1 - level) < 0:
            out.append(round(x0 + (level - y0) * (x1 - x0) / (y1 - y0), 2))
    return out


def _arms(gpus: int, ratios_: Sequence[str]) -> dict[str, tuple[int, int]]:
    arms = {"aggregated": (0, gpus)}
    for spec in ratios_:
        p, d = (int(x) for x in spec.split(":"))
        if p + d != gpus:
            raise SystemExit(f"--ratios {spec}: P + D must be --gpus ({gpus}) for equal GPUs")
        arms[f"{p}P:{d}D"] = (p, d)
    return arms


def run_rate(
    args: argparse.Namespace, rate: float, arms: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    reqs = workload(rate, args.duration_s, args.long_share, args.seed)
    config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens)
    timing = TimingModel(
        step_overhead_ms=args.step_overhead_ms,
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_ms_per_seq=args.decode_ms_per_seq,
        kv_load_ms_per_token=args.kv_load_ms_per_token,
    )
    window = args.duration_s - args.warmup_s
    out: dict[str, Any] = {"rate_rps": rate, "arms": {}}
    for name, (p, d) in arms.items():
        outcome = simulate(
            reqs, prefill=p, decode=d, config=config, timing=timing, warmup_s=args.warmup_s
        )
        out["arms"][name] = report(
            outcome, window_s=window, slo_ttft_s=args.slo_ttft_s, slo_itl_s=args.slo_itl_s
        )
    base = out["arms"]["aggregated"]
    for name, arm in out["arms"].items():
        if name != "aggregated":
            arm["vs_aggregated"] = ratios(arm, base)
    return out


def _chart(sweep: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install llmgw[bench])"
    rates = [s["rate_rps"] for s in sweep]
    names = list(sweep[0]["arms"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (
        ("goodput_rps", None, "goodput (req/s within SLO)"),
        ("ttft_ms", "p90", "TTFT p90 (ms)"),
        ("itl_ms", "p90", "ITL p90 (ms)"),
    )
    for ax, (key, sub, label) in zip(axes, panels, strict=True):
        for name in names:
            ys = [s["arms"][name][key] if sub is None else s["arms"][name][key][sub] for s in sweep]
            ax.plot(rates, ys, marker="o", label=name)
        ax.set_xlabel("offered requests/s")
        ax.set_ylabel(label)
        if key != "goodput_rps":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].plot(rates, rates, linestyle=":", color="grey", label="offered")
    axes[1].axhline(args.slo_ttft_s * 1e3, linestyle="--", color="grey")
    axes[2].axhline(args.slo_itl_s * 1e3, linestyle="--", color="grey")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{args.gpus} GPUs, {args.long_share:.0%} long prompts; SLO: TTFT <= {args.slo_ttft_s} s "
        f"and per-request ITL p90 <= {args.slo_itl_s * 1e3:.0f} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    started = time.perf_counter()
    arms = _arms(args.gpus, args.ratios)
    rates = sorted({*args.sweep_rates, args.rate})
    sweep = [run_rate(args, rate, arms) for rate in rates]
    headline = next(s for s in sweep if s["rate_rps"] == args.rate)
    out: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
        "model": {
            "timing": {k: getattr(TimingModel(), k) for k in TimingModel.__dataclass_fields__},
            "scheduler": {
                k: getattr(SchedulerConfig(), k) for k in SchedulerConfig.__dataclass_fields__
            },
            "long": {"prompt": LONG_IN, "output": LONG_OUT},
            "short": {"prompt": SHORT_IN, "output": SHORT_OUT},
        },
        "headline": headline,
        "target": {},
        "sweep": sweep,
        "goodput_ratio_by_rate": {},
        "goodput_crosses_1_at_rps": {},
    }
    base_itl = headline["arms"]["aggregated"]["itl_ms"]["p90"]
    for name in arms:
        if name == "aggregated":
            continue
        arm = headline["arms"][name]
        out["target"][name] = {
            "itl_p90_ratio": arm["vs_aggregated"]["itl_p90"],
            "itl_p90_at_most_0.6x": arm["itl_ms"]["p90"] <= 0.6 * base_itl,
            "ttft_p90_ratio": arm["vs_aggregated"]["ttft_p90"],
            "goodput_ratio": arm["vs_aggregated"]["goodput"],
        }
        by_rate = [s["arms"][name]["vs_aggregated"]["goodput"] for s in sweep]
        out["goodput_ratio_by_rate"][name] = dict(zip(rates, by_rate, strict=True))
        out["goodput_crosses_1_at_rps"][name] = crossings(rates, by_rate)
    if args.png:
        out["chart"] = _chart(sweep, args, Path(args.png))
    out["run_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


def _print_table(out: dict[str, Any]) -> None:
    print(f"{'rate':>5} {'arm':>10} {'TTFT p50/p90 ms':>18} {'ITL p50/p90/p99 ms':>20} "
          f"{'TPOT p90':>8} {'goodput':>8} {'ratios ttft90/itl90/tpot90/goodput':>34}  stepping")  # fmt: skip
    for s in out["sweep"]:
        for name, a in s["arms"].items():
            r = a.get("vs_aggregated")
            rs = f"{r['ttft_p90']}/{r['itl_p90']}/{r['tpot_p90']}/{r['goodput']}" if r else ""
            print(
                f"{s['rate_rps']:>5} {name:>10} "
                f"{a['ttft_ms']['p50']:>8}/{a['ttft_ms']['p90']:<9} "
                f"{a['itl_ms']['p50']:>6}/{a['itl_ms']['p90']}/{a['itl_ms']['p99']:<8} "
                f"{a['tpot_ms']['p90']:>8} {a['goodput_rps']:>8} {rs:>34}  {a['stepping_share']}"
            )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--ratios", nargs="+", default=["2:6", "4:4"], help="P:D, summing to --gpus")
    ap.add_argument("--rate", type=float, default=20.0, help="the headline's requests/s")
    ap.add_argument(
        "--sweep-rates", type=float, nargs="*", default=[8.0, 12.0, 16.0, 24.0, 28.0, 32.0, 36.0]
    )
    ap.add_argument("--long-share", type=float, default=0.5)
    ap.add_argument("--duration-s", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--warmup-s", type=float, default=10.0, help="arrivals not counted")
    ap.add_argument("--slo-ttft-s", type=float, default=2.0)
    ap.add_argument("--slo-itl-s", type=float, default=0.05, help="per request, on its ITL p90")
    ap.add_argument("--seed", type=int, default=0)
    defaults = TimingModel()
    ap.add_argument("--step-overhead-ms", type=float, default=defaults.step_overhead_ms)
    ap.add_argument("--prefill-ms-per-token", type=float, default=defaults.prefill_ms_per_token)
    ap.add_argument("--decode-ms-per-seq", type=float, default=defaults.decode_ms_per_seq)
    ap.add_argument("--kv-load-ms-per-token", type=float, default=defaults.kv_load_ms_per_token)
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig().max_num_batched_tokens
    )
    ap.add_argument("--json", default=str(ROOT / "docs/bench/pd.json"))
    ap.add_argument("--png", default=str(ROOT / "docs/bench/pd.png"))
    return ap.parse_args(argv)


if __name__ == "__main__":
    result = main()
    _print_table(result)
    print(json.dumps({k: result[k] for k in ("target", "goodput_ratio_by_rate",
                      "goodput_crosses_1_at_rps", "run_s")}, indent=2))  # fmt: skip
