"""Benchmark: demand-driven replicas on a bursty day, four policies on one trace.

The replicas are *modelled*, in this process, not simengine processes: a day of traffic
against real engines would take a day, and the question is what each policy decides, not how
fast a process starts. What is real is llmgw's decider (``planner.autoscale.decide``, called
every control tick exactly as the leader calls it, on the samples the gateways would report).
The model, stated:

- a replica computes prefill at ``--prefill-tps`` tokens/s, one request at a time (FIFO); a
  request's TTFT is its wait in that FIFO plus its own prefill; decode lasts ``--decode-s``;
- prompts: ``--prompt-tokens`` each, of which ``--prefix-tokens`` are one of ``--groups``
  shared prefixes; a replica's KV cache holds its ``--cache-groups`` most recently used
  prefixes (a hit computes only the rest); a started, woken or resumed replica starts empty
  (the simulator's suspend frees its KV cache, as vLLM's sleep level 1 does);
- routing (the same for every policy): a replica holding the prefix unless its queue is a
  miss's prefill longer than the shortest queue, else the shortest queue;
- cold start ``--start-s`` (weights loaded, engine up); wake from suspend ``--wake-s``;
- requests finding no ready replica are held at the gateway up to ``--queue-timeout-s``
  (then failed: 503); a held request is sent when a replica is ready. Scale-down drains:
  a retired replica takes nothing new and finishes what it holds, so nothing is lost by
  construction, and ``lost`` counts any request a stop would have cut (expected 0);
- a control tick every ``--tick-s``; a held request at zero replicas also wakes the
  decider at once (the gateway's NOTIFY).

Policies: fixed at max; fixed at min (1: a fixed fleet of 0 serves nothing); a KEDA-style
rule on the engines' waiting requests as vLLM production-stack ships it (HPA: desired =
ceil(waiting / target), scale-up at most doubling per 15 s, scale-down stabilised over 300 s,
min 1: engine metrics vanish at zero replicas, so the rule cannot wake from zero; cold starts
only); llmgw's autoscaler (min 0, queued uncached prefill target, suspend then stop).

Reported per policy: replica-seconds (GPU held: starting, serving, draining or suspended)
and serving replica-seconds, TTFT p50/p90, the share of requests within ``--slo-s``, held,
failed and lost requests, and the TTFT of each first request after an idle gap. Targets:
llmgw >= 40 % fewer replica-seconds than fixed max at >= 95 % of its SLO attainment, ahead of
the KEDA rule on both; 0 lost; first token after a gap with a suspended replica within wake
+ 1 s.

    .venv/bin/python bench/autoscale.py [--hours 1] [--png autoscale.png] [--seed 0]

Prints one JSON object; writes the chart (offered load, replicas, TTFT over time) to --png.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.planner.autoscale import (
    AutoscalePolicy,
    DemandSample,
    History,
    ScaleState,
    decide,
)

_T0 = datetime(2026, 1, 1, tzinfo=UTC)


# --- the trace --------------------------------------------------------------------------


def rate_at(t: float, hour_s: float, peak_rps: float) -> float:
    """Offered requests/s at ``t`` of a day compressed into ``hour_s``-second "hours": quiet,
    a ramp, a plateau with spikes, a fall, an idle gap past zero_after_s, a short burst, an
    idle gap past suspend_after_s only, a moderate tail."""
    u = t / hour_s  # in "hours", 0..6
    if u < 1.0:
        return 0.05 * peak_rps
    if u < 2.0:
        return peak_rps * (0.05 + 0.95 * (u - 1.0))
    if u < 2.5:
        spike = (t % (hour_s / 6)) < hour_s / 30
        return peak_rps * (2.0 if spike else 1.0)
    if u < 3.0:
        return peak_rps * (1.0 - 1.8 * (u - 2.5))
    if u < 4.2:
        return 0.0
    if u < 4.3:
        return 0.3 * peak_rps
    if u < 4.5:
        return 0.0
    return 0.3 * peak_rps


@dataclass(frozen=True, slots=True)
class Request:
    at: float
    group: int


def trace(
    duration_s: float, hour_s: float, peak_rps: float, groups: int, seed: int
) -> list[Request]:
    rng = random.Random(seed)
    out = []
    t = 0.0
    lam_max = 2.0 * peak_rps
    while True:  # thinning: a Poisson process of the varying rate
        t += rng.expovariate(lam_max)
        if t >= duration_s:
            return out
        if rng.random() * lam_max < rate_at(t, hour_s, peak_rps):
            # Zipf-like popularity: a few prefixes carry most requests.
            out.append(Request(t, min(int(rng.paretovariate(1.2)) - 1, groups - 1)))


# --- the modelled fleet -----------------------------------------------------------------


@dataclass(slots=True)
class Replica:
    id: int
    state: str  # starting | ready | draining | suspended | waking | stopped
    since: float
    ready_at: float = 0.0
    free_at: float = 0.0  # when its prefill FIFO empties
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    drain_to: str = "stopped"  # what a draining replica becomes once it is empty
    # (start of prefill, first token, end) of what it holds, for waiting/in-flight counts.
    work: deque[tuple[float, float, float]] = field(default_factory=deque)


@dataclass(slots=True)
class Model:
    args: argparse.Namespace
    replicas: list[Replica] = field(default_factory=list)
    held: deque[Request] = field(default_factory=deque)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (arrival, ttft)
    failed: int = 0
    lost: int = 0
    held_total: int = 0
    replica_s: float = 0.0
    serving_s: float = 0.0
    suspended_s: float = 0.0
    starting_s: float = 0.0
    wakes: int = 0
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # t, serving, placed
    gaps: list[dict[str, Any]] = field(default_factory=list)
    next_id: int = 0

    # lifecycle ----------------------------------------------------------------------

    def ready(self, now: float) -> list[Replica]:
        return [r for r in self.replicas if r.state == "ready"]

    def advance(self, now: float) -> None:
        a = self.args
        for r in self.replicas:
            if r.state in ("starting", "waking") and now >= r.ready_at:
                r.state, r.since, r.free_at = "ready", r.ready_at, max(r.free_at, r.ready_at)
                r.cache.clear()
            elif r.state == "draining" and now >= r.free_at + a.decode_s:
                r.state = r.drain_to
        self.replicas = [r for r in self.replicas if r.state != "stopped"]

    def start(self, now: float) -> None:
        a = self.args
        self.replicas.append(Replica(self.next_id, "starting", now, ready_at=now + a.start_s))
        self.next_id += 1

    def scale_to(self, now: float, serving: int, placed: int) -> None:
        """Converge like the planner: wake suspended first, then start; retire the newest
        (drained first), suspending up to ``placed`` and stopping the rest."""
        a = self.args
        live = [r for r in self.replicas if r.state in ("starting", "waking", "ready")]
        asleep = [r for r in self.replicas if r.state == "suspended"]
        while len(live) < serving and asleep:
            r = asleep.pop(0)
            r.state, r.ready_at = "waking", now + a.wake_s
            self.wakes += 1
            live.append(r)
        while len(live) < serving:
            self.start(now)
            live.append(self.replicas[-1])
        surplus = sorted(live, key=lambda r: (r.state == "ready", -r.since))[
            : max(0, len(live) - serving)
        ]
        keep = max(0, placed - serving - len(asleep))
        for r in surplus:
            if r.state != "ready":
                r.state = "stopped"  # starting: nothing to drain
                continue
            r.state = "draining"
            r.drain_to = "suspended" if keep > 0 else "stopped"
            keep -= 1 if keep > 0 else 0
        excess = max(0, len(asleep) - max(0, placed - serving))
        for r in asleep[len(asleep) - excess :]:
            r.state = "stopped"
        self.replicas = [r for r in self.replicas if r.state != "stopped"]

    # requests -----------------------------------------------------------------------

    def route(self, req: Request, now: float) -> None:
        a = self.args
        ready = self.ready(now)
        miss_s = a.prompt_tokens / a.prefill_tps
        shortest = min(ready, key=lambda r: r.free_at)
        holders = [r for r in ready if req.group in r.cache]
        best = min(holders, key=lambda r: r.free_at) if holders else None
        if best is not None and best.free_at - max(now, shortest.free_at) <= miss_s:
            r, hit = best, True
        else:
            r, hit = shortest, False
        tokens = a.prompt_tokens - (a.prefix_tokens if hit else 0)
        start = max(now, r.free_at)
        first = start + tokens / a.prefill_tps
        r.free_at = first
        r.cache[req.group] = None
        r.cache.move_to_end(req.group)
        while len(r.cache) > a.cache_groups:
            r.cache.popitem(last=False)
        r.work.append((start, first, first + a.decode_s))
        self.ttft.append((req.at, first - req.at))

    def arrive(self, req: Request, now: float) -> None:
        if self.ready(now):
            self.route(req, now)
        else:
            self.held.append(req)
            self.held_total += 1

    def release_held(self, now: float) -> None:
        a = self.args
        while self.held and now - self.held[0].at > a.queue_timeout_s:
            self.held.popleft()
            self.failed += 1
        if self.ready(now):
            while self.held:
                self.route(self.held.popleft(), now)

    # signals ------------------------------------------------------------------------

    def sample(self, now: float) -> DemandSample:
        a = self.args
        waiting = len(self.held)
        in_flight = 0
        uncached = sum(a.prompt_tokens for _ in self.held)
        for r in self.replicas:
            while r.work and r.work[0][2] <= now:
                r.work.popleft()
            for start, _first, _end in r.work:
                in_flight += 1
                if start > now:
                    waiting += 1
            if r.state in ("ready", "draining"):
                uncached += int(max(0.0, r.free_at - now) * a.prefill_tps)
        return DemandSample(
            at=_T0 + timedelta(seconds=now),
            gateways=1,
            waiting_requests=waiting,
            queued_prefill_tokens=uncached,
            uncached_prefill_tokens=uncached,
            in_flight=in_flight,
            held=len(self.held),
        )

    def engine_waiting(self, now: float) -> int:
        """What vLLM's num_requests_waiting would sum to: queued inside ready engines."""
        return sum(1 for r in self.replicas for s, _f, _e in r.work if s > now)

    def account(self, dt: float, now: float) -> None:
        placed = len(self.replicas)
        serving = len(self.ready(now))
        self.replica_s += placed * dt
        self.serving_s += serving * dt
        self.suspended_s += sum(1 for r in self.replicas if r.state == "suspended") * dt
        self.starting_s += sum(1 for r in self.replicas if r.state in ("starting", "waking")) * dt
        self.timeline.append((now, serving, placed))


# --- policies: (model, now, woken) -> (serving, placed) or None ---------------------------

Policy = Callable[[Model, float], tuple[int, int] | None]


def fixed(n: int) -> Policy:
    def p(m: Model, now: float) -> tuple[int, int] | None:
        return (n, n)

    return p


def keda(target_waiting: float, max_replicas: int) -> Policy:
    """HPA over an engine-waiting metric (production-stack's KEDA ScaledObject)."""
    recs: deque[tuple[float, int]] = deque()
    last_up = [-1e9]
    current = [1]

    def p(m: Model, now: float) -> tuple[int, int] | None:
        want = max(1, min(max_replicas, math.ceil(m.engine_waiting(now) / target_waiting)))
        recs.append((now, want))
        while recs and now - recs[0][0] > 300:
            recs.popleft()
        n = current[0]
        if want > n and now - last_up[0] >= 15:
            n = min(want, 2 * n, max_replicas)
            last_up[0] = now
        elif want < n:
            n = max(max(w for _, w in recs), 1)
        current[0] = n
        return (n, n)

    return p


def llmgw(policy: AutoscalePolicy, initial: int) -> Policy:
    samples: deque[DemandSample] = deque()
    state = [ScaleState(desired=initial, warm=initial)]

    def p(m: Model, now: float) -> tuple[int, int] | None:
        samples.append(m.sample(now))
        while samples and (samples[-1].at - samples[0].at).total_seconds() > 3600:
            samples.popleft()
        st = replace(state[0], ready=len(m.ready(now)))
        d = decide(History(tuple(samples), st), policy, _T0 + timedelta(seconds=now))
        state[0] = ScaleState(
            d.desired, d.warm, d.last_scaled_at, d.idle_since, suspended_since=d.suspended_since
        )
        return (d.desired, d.warm)

    return p


# --- the run ----------------------------------------------------------------------------


def simulate(args: argparse.Namespace, reqs: list[Request], policy: Policy, initial: int) -> Model:
    m = Model(args)
    for _ in range(initial):
        m.start(-args.start_s)  # ready at t=0, as a fleet that was already up
    m.advance(0.0)
    duration = args.hours * args.hour_s
    events: list[tuple[float, int, int]] = [(r.at, 1, i) for i, r in enumerate(reqs)]
    tick = 0.0
    while tick <= duration:
        events.append((tick, 0, -1))
        tick += args.tick_s
    heapq.heapify(events)
    prev = 0.0
    gaps = m.gaps
    last_arrival = -1e9
    while events:
        now, kind, i = heapq.heappop(events)
        m.account(now - prev, now)
        prev = now
        m.advance(now)
        m.release_held(now)
        if kind == 1:
            req = reqs[i]
            if now - last_arrival > args.gap_s:
                gaps.append({"at_s": now, "idle_s": round(now - max(last_arrival, 0))})
            last_arrival = now
            had_ready = bool(m.ready(now))
            asleep = any(r.state == "suspended" for r in m.replicas)
            m.arrive(req, now)
            if not had_ready:
                # The gateway's NOTIFY: the decider runs at once, not at the next tick.
                decided = policy(m, now)
                if decided is not None:
                    m.scale_to(now, *decided)
                if gaps and gaps[-1]["at_s"] == now:
                    gaps[-1]["replica_was"] = "suspended" if asleep else "stopped"
            continue
        decided = policy(m, now)
        if decided is not None:
            m.scale_to(now, *decided)
        m.advance(now)
        m.release_held(now)
    m.advance(duration + 3600)
    m.release_held(duration + 3600)
    m.failed += len(m.held)
    return m


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _report(m: Model, reqs: list[Request], slo_s: float) -> dict[str, Any]:
    ttfts = [t for _, t in m.ttft]
    by_arrival = dict(m.ttft)
    gaps = []
    for g in m.gaps:
        ttft = by_arrival.get(g["at_s"])
        gaps.append({**g, "at_s": round(g["at_s"], 1),
                     "first_ttft_s": None if ttft is None else round(ttft, 3)})  # fmt: skip
    return {
        "requests": len(reqs),
        "answered": len(ttfts),
        "held": m.held_total,
        "failed": m.failed,
        "lost": m.lost,
        "replica_seconds": round(m.replica_s),
        "serving_replica_seconds": round(m.serving_s),
        "suspended_replica_seconds": round(m.suspended_s),
        "starting_replica_seconds": round(m.starting_s),
        "cold_starts": m.next_id,
        "wakes": m.wakes,
        "ttft_s": {"p50": round(_pct(ttfts, 0.5), 3), "p90": round(_pct(ttfts, 0.9), 3)},
        "slo_attainment": round(sum(1 for t in ttfts if t <= slo_s) / max(1, len(reqs)), 4),
        "gaps": [g for g in gaps if g.get("replica_was")],
    }


def _chart(
    args: argparse.Namespace, reqs: list[Request], runs: dict[str, Model], path: Path
) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install llmgw[bench])"
    duration = args.hours * args.hour_s
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    xs = [i * args.tick_s for i in range(int(duration / args.tick_s))]
    ax1.plot(xs, [rate_at(x, args.hour_s, args.peak_rps) for x in xs], color="black")
    ax1.set_ylabel("offered requests/s")
    for name, m in runs.items():
        ax2.step(
            [t for t, _, _ in m.timeline],
            [s for _, s, _ in m.timeline],
            where="post",
            label=f"{name} serving",
        )
        bins: dict[int, list[float]] = {}
        for at, t in m.ttft:
            bins.setdefault(int(at // 30), []).append(t)
        ax3.plot(
            [k * 30 for k in sorted(bins)], [_pct(bins[k], 0.9) for k in sorted(bins)], label=name
        )
    ax2.set_ylabel("replicas serving")
    ax2.legend(fontsize=8)
    ax3.set_ylabel("TTFT p90 per 30 s (s)")
    ax3.set_yscale("log")
    ax3.axhline(args.slo_s, linestyle="--", color="grey")
    ax3.set_xlabel("seconds")
    ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.hours * args.hour_s
    reqs = trace(duration, args.hour_s, args.peak_rps, args.groups, args.seed)
    policy = AutoscalePolicy(
        min_replicas=0,
        max_replicas=args.max_replicas,
        target_queued_prefill_tokens=args.target_tokens,
        scale_up_window_s=args.up_window_s,
        scale_down_window_s=args.down_window_s,
        suspend_after_s=args.suspend_after_s,
        zero_after_s=args.zero_after_s,
    )
    policies: dict[str, tuple[Policy, int]] = {
        "fixed_max": (fixed(args.max_replicas), args.max_replicas),
        "fixed_min": (fixed(1), 1),
        "keda_waiting": (keda(args.keda_target_waiting, args.max_replicas), 1),
        # Every elastic policy starts where the KEDA rule must: one replica up.
        "llmgw": (llmgw(policy, 1), 1),
        # Not one of the four: the same decider kept at one replica like the KEDA rule, to
        # tell what scaling to zero costs on this trace from what the signal gains.
        "llmgw_min1": (llmgw(replace(policy, min_replicas=1), 1), 1),
    }
    runs = {name: simulate(args, reqs, p, initial) for name, (p, initial) in policies.items()}
    out: dict[str, Any] = {
        "model": {
            "start_s": args.start_s, "wake_s": args.wake_s, "prefill_tps": args.prefill_tps,
            "decode_s": args.decode_s, "prompt_tokens": args.prompt_tokens,
            "prefix_tokens": args.prefix_tokens, "slo_ttft_s": args.slo_s,
            "duration_s": duration, "tick_s": args.tick_s,
        },
        "policy": {k: getattr(policy, k) for k in policy.__dataclass_fields__},
        "runs": {name: _report(m, reqs, args.slo_s) for name, m in runs.items()},
    }  # fmt: skip
    r = out["runs"]
    fm, lg, kd = r["fixed_max"], r["llmgw"], r["keda_waiting"]
    wake_gaps = [g for g in lg["gaps"] if g["replica_was"] == "suspended"]
    out["ratios"] = {
        "replica_seconds_saved_vs_fixed_max": round(
            1 - lg["replica_seconds"] / fm["replica_seconds"], 3
        ),
        "slo_attainment_vs_fixed_max": round(
            lg["slo_attainment"] / max(fm["slo_attainment"], 1e-9), 3
        ),
        "replica_seconds_vs_keda": round(lg["replica_seconds"] / max(kd["replica_seconds"], 1), 3),
        "slo_attainment_vs_keda": round(lg["slo_attainment"] / max(kd["slo_attainment"], 1e-9), 3),
    }
    out["targets"] = {
        "replica_seconds_40pct_below_fixed_max": out["ratios"]["replica_seconds_saved_vs_fixed_max"] >= 0.40,
        "slo_95pct_of_fixed_max": out["ratios"]["slo_attainment_vs_fixed_max"] >= 0.95,
        "ahead_of_keda_on_both": lg["replica_seconds"] < kd["replica_seconds"] and lg["slo_attainment"] > kd["slo_attainment"],
        "zero_lost": lg["lost"] == 0,
        "suspended_wake_first_token_within_wake_plus_1s": bool(wake_gaps) and all(
            g["first_ttft_s"] is not None and g["first_ttft_s"] <= args.wake_s + 1 for g in wake_gaps
        ),
    }  # fmt: skip
    if args.png:
        out["chart"] = _chart(args, reqs, runs, Path(args.png))
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hours", type=float, default=6.0, help="compressed hours of the day")
    ap.add_argument("--hour-s", type=float, default=600.0, help="seconds per compressed hour")
    ap.add_argument("--peak-rps", type=float, default=24.0)
    ap.add_argument("--max-replicas", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--prefix-tokens", type=int, default=3000)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--cache-groups", type=int, default=16)
    ap.add_argument("--prefill-tps", type=float, default=16_000.0)
    ap.add_argument("--decode-s", type=float, default=3.0)
    ap.add_argument("--start-s", type=float, default=60.0)
    ap.add_argument("--wake-s", type=float, default=5.0)
    ap.add_argument("--queue-timeout-s", type=float, default=120.0)
    ap.add_argument("--tick-s", type=float, default=2.0)
    ap.add_argument("--slo-s", type=float, default=2.0, help="TTFT objective")
    ap.add_argument("--target-tokens", type=int, default=1000)
    ap.add_argument("--up-window-s", type=float, default=6.0)
    ap.add_argument("--down-window-s", type=float, default=120.0)
    ap.add_argument("--suspend-after-s", type=float, default=30.0)
    ap.add_argument("--zero-after-s", type=float, default=200.0)
    ap.add_argument("--keda-target-waiting", type=float, default=4.0)
    ap.add_argument("--gap-s", type=float, default=30.0, help="an idle stretch this long is a gap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--png", default="")
    return ap.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(run(parse()), indent=2))
