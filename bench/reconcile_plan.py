"""Benchmark: the reconciler's pure planning time on synthetic fleets (no database).

Fleets of N nodes × 8 H100s on one InfiniBand fabric, 2 deployments per 10 nodes
(one of 4 replicas × 4 GPUs, one of 3 replicas × 8 GPUs; every fifth of those a
2-node × 8-GPU replica instead), all placed and ready, so the fleet is half full.
Per fleet size it times, best of ``--reps`` with the cyclic GC paused:

- ``noop_ms``: compute_plan on the settled fleet (what every periodic pass costs);
- ``one_rollout_ms``: one deployment's profile edited (a surge replica placed);
- ``initial_ms``: placing the whole fleet from nothing (sizes up to ``--initial-max``;
  each replica scans every node, so this grows as nodes × replicas).

The database half of a pass (load + no-op apply, queries per pass) is the
shell's benchmark, bench/reconcile.py. Prints one JSON object; targets (issue
[controlplane]): 1,000 nodes well under 1 s, growth no worse than linear.

    .venv/bin/python bench/reconcile_plan.py --sizes 100 1000 5000
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from llmgw.engines.requirements import PlacementRequirements
from llmgw.planner import (
    GPU,
    DeploymentId,
    DeploymentView,
    Fabric,
    FabricName,
    NodeId,
    NodeView,
    PlanSettings,
    ProfileView,
    ReplicaId,
    ReplicaView,
    ShardId,
    ShardView,
    Snapshot,
    apply_to_snapshot,
    compute_plan,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
H100 = "NVIDIA H100 80GB HBM3"
SETTINGS = PlanSettings(gpu_class_patterns=(("h100", "H100"),))


def _reqs(gpus: int, nodes: int) -> PlacementRequirements:
    return PlacementRequirements(
        gpu_class="h100",
        nodes=nodes,
        gpus_per_node=gpus,
        threads=0,
        cpu_only=False,
        mig_allowed=gpus == 1 and nodes == 1,
        same_gpu_indices_across_nodes=False,
        same_hcas_across_nodes=False,
    )


def _fleet(num_nodes: int) -> Snapshot:
    """A settled fleet built directly (placing it through the planner is `initial_ms`)."""
    nodes = [
        NodeView(
            id=NodeId(f"node-{i:05d}"),
            name=f"node-{i:05d}",
            gpus=tuple(GPU(g, H100, f"GPU-{i}-{g}") for g in range(8)),
            fabrics=(Fabric(FabricName("ib0"), ("mlx5_0", "mlx5_1")),),
            last_sync_at=NOW,
        )
        for i in range(num_nodes)
    ]
    deployments: list[DeploymentView] = []
    replicas: list[ReplicaView] = []
    free = {n.id: list(range(8)) for n in nodes}
    cursor = 0

    def take(gpus: int) -> tuple[NodeId, tuple[int, ...]]:
        nonlocal cursor
        while len(free[nodes[cursor].id]) < gpus:
            cursor += 1
        nid = nodes[cursor].id
        got, free[nid] = tuple(free[nid][:gpus]), free[nid][gpus:]
        return nid, got

    for g in range(num_nodes // 10):
        for k, (count, gpus, span) in enumerate([(4, 4, 1), (3, 8, 1) if g % 5 else (1, 8, 2)]):
            did = DeploymentId(f"dep-{g}-{k}")
            prof = ProfileView(f"p-{g}-{k}", "vllm", f"fp-{g}-{k}", _reqs(gpus, span))
            deployments.append(DeploymentView(did, did, prof, count))
            for r in range(count):
                rid = ReplicaId(f"{did}-r{r}")
                shards = []
                for rank in range(span):
                    nid, idx = take(gpus)
                    shards.append(
                        ShardView(
                            ShardId(f"{rid}-{rank}"), rid, nid, rank,
                            gpu_indices=idx, gpu_keys=tuple(map(str, idx)),
                            fabric="ib0" if span > 1 else "",
                            hcas=("mlx5_0", "mlx5_1") if span > 1 else (),
                            leader_port=29500 + r if rank == 0 else None,
                            observed_state="ready",
                        )
                    )  # fmt: skip
                replicas.append(ReplicaView(rid, did, prof.fingerprint, NOW, tuple(shards)))
    snap = Snapshot(tuple(deployments), tuple(nodes), tuple(replicas), SETTINGS)
    # The first pass only writes statuses; after it the fleet is settled.
    snap = apply_to_snapshot(snap, compute_plan(snap, NOW), NOW)
    assert not compute_plan(snap, NOW).actions, "synthetic fleet is not settled"
    return snap


def _best(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
    return best


def _measure(num_nodes: int, reps: int, initial_max: int) -> dict[str, object]:
    snap = _fleet(num_nodes)
    later = NOW + timedelta(seconds=1)
    noop = _best(lambda: compute_plan(snap, later), reps)
    d0 = snap.deployments[0]
    edited = replace(
        snap,
        deployments=(
            replace(d0, profile=replace(d0.profile, fingerprint="fp-new"), generation=2),
            *snap.deployments[1:],
        ),
    )
    rollout_plan = compute_plan(edited, later)
    one_rollout = _best(lambda: compute_plan(edited, later), reps)
    row: dict[str, object] = {
        "nodes": num_nodes,
        "gpus": num_nodes * 8,
        "deployments": len(snap.deployments),
        "replicas": len(snap.replicas),
        "noop_ms": round(noop * 1e3, 3),
        "noop_us_per_node": round(noop * 1e6 / num_nodes, 2),
        "one_rollout_ms": round(one_rollout * 1e3, 3),
        "one_rollout_actions": rollout_plan.counts(),
    }
    if num_nodes <= initial_max:
        empty = replace(snap, replicas=())
        first = compute_plan(empty, later)
        row["initial_ms"] = round(_best(lambda: compute_plan(empty, later), 1) * 1e3, 1)
        row["initial_replicas_created"] = first.counts().get("CreateReplica", 0)
    return row


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--initial-max", type=int, default=1000)
    args = ap.parse_args(argv)
    rows = [_measure(n, args.reps, args.initial_max) for n in args.sizes]
    out: dict[str, object] = {"benchmark": "reconcile_plan", "fleets": rows}
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        size_ratio = float(str(last["nodes"])) / float(str(first["nodes"]))
        # Above 1: the no-op pass grows faster than the fleet.
        out["noop_growth_vs_linear"] = round(
            float(str(last["noop_ms"])) / float(str(first["noop_ms"])) / size_ratio, 2
        )
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
