"""Benchmark: the router's prefix index beside a bare set-per-shard floor, in one run.

Workload: one model on ``--shards`` shards holding ``--entries`` (block, shard) pairs in all; a
block is held by 1 shard (70%), 2 (20%) or 4 (10%), each shard's hashes arriving as separately
decoded uint64 lists in deltas of ``--batch`` (``--disjoint``: every block on one shard, the
index's worst case for memory). The floor does the same work with a Python ``set`` per shard:
``set.update`` per delta, and per replica a loop of ``in`` tests until the first miss to score.

Figures: ingest rate (block adds/s), memory per (block, shard) entry (tracemalloc of what each
structure keeps alive, its int objects included) and the latency of scoring a
``--prompt-blocks`` prompt over all shards, where replica r holds the prompt's first
r/shards of blocks. Best of ``--reps`` runs, GC paused; quote ratios, not absolute times.

    .venv/bin/python bench/kv_index.py --entries 1000000

Targets (issue [kv]): ingest >= 30% of the floor's rate, memory <= 1.5x the floor's, score <=
2x the floor's lookups.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import tracemalloc
from collections.abc import Callable

from llmgw.kv.index import PrefixIndex


def _workload(entries: int, shards: int, disjoint: bool, seed: int) -> list[list[int]]:
    """Per shard, its hashes (fresh int objects per shard, as decoding makes them)."""
    rng = random.Random(seed)
    per_shard: list[list[int]] = [[] for _ in range(shards)]
    total = 0
    while total < entries:
        h = rng.getrandbits(64)
        r = rng.random()
        k = 1 if disjoint or r < 0.7 else 2 if r < 0.9 else 4
        k = min(k, shards, entries - total)
        for s in rng.sample(range(shards), k):
            per_shard[s].append(h ^ 0)  # a distinct int object per shard
        total += k
    return per_shard


def _batches(per_shard: list[list[int]], size: int) -> list[tuple[int, list[int]]]:
    out = []
    for s, hashes in enumerate(per_shard):
        out.extend((s, hashes[i : i + size]) for i in range(0, len(hashes), size))
    random.Random(7).shuffle(out)  # shards interleave as agents report concurrently
    return out


def _best(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _ingest_floor(batches: list[tuple[int, list[int]]], shards: int) -> list[set[int]]:
    sets: list[set[int]] = [set() for _ in range(shards)]
    for s, hashes in batches:
        sets[s].update(hashes)
    return sets


def _ingest_index(batches: list[tuple[int, list[int]]], names: list[str]) -> PrefixIndex:
    idx = PrefixIndex()
    apply = idx.apply_delta
    for s, hashes in batches:
        apply("model", names[s], hashes)
    return idx


def _retained_bytes(
    build: Callable[[list[tuple[int, list[int]]]], object],
    batches: list[tuple[int, list[int]]],
) -> int:
    # Fresh int objects made under tracing, so what the structure keeps alive is counted.
    gc.collect()
    tracemalloc.start()
    fresh = [(s, [h ^ 0 for h in hashes]) for s, hashes in batches]
    structure = build(fresh)
    del fresh
    gc.collect()
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del structure
    return size


def _score_times(
    sets: list[set[int]], idx: PrefixIndex, names: list[str], args: argparse.Namespace
) -> tuple[float, float]:
    """Best times to score one prompt: per-shard set lookups vs the index."""
    # Replica r holds the prompt's first r * blocks / shards blocks.
    rng = random.Random(args.seed + 1)
    prompt = [rng.getrandbits(64) for _ in range(args.prompt_blocks)]
    for r, name in enumerate(names):
        depth = r * args.prompt_blocks // args.shards
        idx.apply_delta("model", name, prompt[:depth])
        sets[r].update(prompt[:depth])

    def score_floor() -> list[int]:
        out = []
        for held in sets:
            n = 0
            for h in prompt:
                if h not in held:
                    break
                n += 1
            out.append(n)
        return out

    got = idx.score("model", prompt, names)
    assert [got[n].matched_blocks for n in names] == score_floor()
    s_floor = _best(score_floor, args.reps * 5)
    s_index = _best(lambda: idx.score("model", prompt, names), args.reps * 5)
    return s_floor, s_index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256, help="hashes per delta")
    ap.add_argument("--prompt-blocks", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--disjoint", action="store_true", help="every block on exactly one shard")
    args = ap.parse_args()
    gc.disable()
    names = [f"shard-{i}" for i in range(args.shards)]

    per_shard = _workload(args.entries, args.shards, args.disjoint, args.seed)
    batches = _batches(per_shard, args.batch)
    n_entries = sum(len(h) for h in per_shard)
    t_floor = _best(lambda: _ingest_floor(batches, args.shards), args.reps)
    t_index = _best(lambda: _ingest_index(batches, names), args.reps)
    sets = _ingest_floor(batches, args.shards)
    idx = _ingest_index(batches, names)
    assert [idx.num_blocks(n) for n in names] == [len(s) for s in sets]

    s_floor, s_index = _score_times(sets, idx, names, args)
    del sets, idx
    gc.collect()

    m_floor = _retained_bytes(lambda b: _ingest_floor(b, args.shards), batches)
    m_index = _retained_bytes(lambda b: _ingest_index(b, names), batches)

    ingest_ratio = t_floor / t_index
    mem_ratio = m_index / m_floor
    score_ratio = s_index / s_floor
    print(
        json.dumps(
            {
                "entries": n_entries,
                "shards": args.shards,
                "delta_size": args.batch,
                "overlap": "disjoint" if args.disjoint else "70% x1, 20% x2, 10% x4",
                "ingest_adds_per_s": {
                    "index": round(n_entries / t_index),
                    "floor_set_per_shard": round(n_entries / t_floor),
                },
                "bytes_per_entry": {
                    "index": round(m_index / n_entries, 1),
                    "floor_set_per_shard": round(m_floor / n_entries, 1),
                },
                "score_us": {
                    "prompt_blocks": args.prompt_blocks,
                    "replicas": args.shards,
                    "index": round(s_index * 1e6, 1),
                    "floor_set_lookups": round(s_floor * 1e6, 1),
                },
                "ratios": {
                    "ingest_index_over_floor": round(ingest_ratio, 2),
                    "memory_index_over_floor": round(mem_ratio, 2),
                    "score_index_over_floor": round(score_ratio, 3),
                },
                "targets": {
                    "ingest>=0.3x_floor": ingest_ratio >= 0.3,
                    "memory<=1.5x_floor": mem_ratio <= 1.5,
                    "score<=2x_floor": score_ratio <= 2,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
