"""Benchmark: one full reconcile pass (load + plan + no-op apply) against a real Postgres.

Starts its own throwaway Postgres (llmgw.embedded_postgres, fsync off, removed at the
end) and, per fleet size, a fresh migrated database holding N nodes × 8 simulated GPUs
and 2 deployments per 10 nodes (one of 4 replicas × 4 GPUs, one of 3 replicas × 8 GPUs,
so the fleet is a bit more than half full). The fleet is placed by the reconciler itself
(``setup_s`` says how long that took), every shard is then marked ready as an agent
would report it, and passes run until the plan is empty. Then, per size:

- ``pass_ms``: ``Reconciler.pass_once`` on the settled fleet (the leader's periodic cost),
  best and median of ``--reps``, with the epoch check, the snapshot load (a constant number
  of queries), ``compute_plan`` and an apply that has nothing to write;
- ``pass_cpu_ms_best``: this process's CPU time in the pass (without Postgres' own), which
  a machine shared with other work distorts far less than wall time; ``..._gc_off``: the
  same with Python's cyclic GC disabled for the pass (what collections cost);
- ``statements_per_pass``: SQL statements the pass sent (SQLAlchemy ``before_cursor_execute``);
  the target is a constant, whatever the fleet's size;
- ``load_ms`` / ``plan_ms``: the pass split into its halves (best of ``--reps``), with the
  cyclic GC paused as the pass pauses it; ``..._cpu_ms``: the same in this process's CPU time.
  A pass remembers the nodes' parsed inventories for the next (reconcile/inventories.py);
  ``load_cold_ms``: the load with none remembered, as a new leader's first pass reads.

Targets (issue [controlplane]): statements per pass constant in fleet size; a pass under 1 s
at 1,000 nodes and at 10,000 nodes (80,000 GPUs, 7,000 replicas); growth no worse than
linear (``growth_vs_linear`` <= 1, the largest fleet's pass time over the smallest's,
divided by the size ratio). Prints one JSON object.

    .venv/bin/python bench/reconcile.py --sizes 100 1000 5000
    .venv/bin/python bench/reconcile.py --sizes 1000 10000   # ~5 min of setup at 10,000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

# The fleet's rows are the reconcile shell's tests' own (tests/support/sim_fleet.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmgw.controlplane.profile_checks import check_profile
from llmgw.controlplane.reconcile import read as reconcile_read
from llmgw.controlplane.reconcile.leader import LeaderLock, check_epoch
from llmgw.controlplane.reconcile.loop import Reconciler
from llmgw.controlplane.reconcile.read import load_snapshot
from llmgw.embedded_postgres import EmbeddedPostgres, create_database, libpq_url
from llmgw.planner.plan import compute_plan
from llmgw.planner.snapshot import PlanSettings
from llmgw.store import migrations
from llmgw.store.database import create_engine, session_factory
from tests.support.sim_fleet import counted_statements, sim_inventory, sim_profile_fields

__all__ = ["main"]

# Nodes never go stale during the run: a slow setup must not turn into node-loss replacements.
SETTINGS = PlanSettings(sync_period_s=2.0, sync_grace_s=86_400.0, drain_timeout_s=60.0)

# Each node's GPU uuids are made unique in SQL at seeding (see _seed).
_INVENTORY = sim_inventory(8, cpu_threads=64)


def _seed(url: str, num_nodes: int) -> int:
    """Nodes, one model, two profiles (tp 4 and tp 8) and the deployments; returns replicas."""
    fp4 = check_profile("sim-tp4", sim_profile_fields(tp=4))
    fp8 = check_profile("sim-tp8", sim_profile_fields(tp=8))
    with psycopg.connect(url, autocommit=True) as conn:
        model = conn.execute("INSERT INTO models (name) VALUES ('m') RETURNING id").fetchone()[0]  # type: ignore[index]
        profiles = {}
        for name, tp, fp in (("sim-tp4", 4, fp4), ("sim-tp8", 8, fp8)):
            profiles[tp] = conn.execute(
                "INSERT INTO profiles (name, model_id, engine, gpu_class, tp, model_path, "
                "kv_hash_seed, fingerprint) VALUES (%s, %s, 'sim', 'sim', %s, 'sim-model', "
                "'4242', %s) RETURNING id",
                (name, model, tp, fp),
            ).fetchone()[0]  # type: ignore[index]
        # Set-based inserts: 5,000 nodes one statement each would dominate the setup.
        conn.execute(
            "INSERT INTO nodes (name, approval_state) "
            "SELECT 'node-' || lpad(i::text, 5, '0'), 'approved' FROM generate_series(1, %s) i",
            (num_nodes,),
        )
        # Each node's GPUs have uuids of their own, as NVML reports them: no two inventories
        # are the same text (the reconciler remembers parsed inventories by their text).
        conn.execute(
            "INSERT INTO node_status (node_id, mgmt_addr, inventory, last_sync_at) "
            "SELECT n.id, '127.0.0.1', jsonb_set(t.doc, '{gpus}', ("
            "  SELECT jsonb_agg(jsonb_set(g, '{uuid}', to_jsonb(n.name || '-' || (g->>'uuid')))"
            "  ORDER BY (g->>'index')::int) FROM jsonb_array_elements(t.doc->'gpus') g)), now() "
            "FROM nodes n, (SELECT %s::jsonb AS doc) t",
            (_INVENTORY,),
        )
        groups = num_nodes // 10
        conn.execute(
            "INSERT INTO deployments (name, model_id, profile_id, replicas) "
            "SELECT 'd' || g || '-tp4', %s, %s, 4 FROM generate_series(1, %s) g "
            "UNION ALL "
            "SELECT 'd' || g || '-tp8', %s, %s, 3 FROM generate_series(1, %s) g",
            (model, profiles[4], groups, model, profiles[8], groups),
        )
    return groups * 7


def _mark_ready(url: str) -> None:
    """What agents would report: every placed shard's engine up on its desired fingerprint."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE shards SET observed_state = 'ready', observed_fingerprint = "
            "profile_fingerprint, http_port = 20000 + (rank * 7 + coalesce(leader_port, 0)) "
            "% 40000, pid = 1000, observed_at = now(), started_at = now() WHERE NOT released"
        )


async def _measure(admin_url: str, num_nodes: int, reps: int) -> dict[str, Any]:
    name = f"bench_reconcile_{num_nodes}"
    url = create_database(admin_url, name)
    migrations.upgrade(url)
    t0 = time.perf_counter()
    replicas = _seed(libpq_url(url), num_nodes)
    engine = create_engine(url, pool_size=2)
    sessions = session_factory(engine)
    lock = LeaderLock(libpq_url(url), instance_id="bench")
    epoch = await lock.try_acquire()
    assert epoch is not None
    rec = Reconciler(
        sessions=sessions, libpq_url=libpq_url(url), instance_id="bench", plan_settings=SETTINGS
    )
    try:
        created = (await rec.pass_once(epoch)).get("CreateReplica", 0)
        _mark_ready(libpq_url(url))
        for _ in range(5):  # statuses settle in a pass or two
            if not await rec.pass_once(epoch):
                break
        else:
            raise AssertionError(f"{num_nodes} nodes: the fleet does not settle")
        setup_s = time.perf_counter() - t0

        times: list[float] = []
        cpu: list[float] = []
        per_pass: list[int] = []
        with counted_statements(engine) as statements:
            for _ in range(reps):
                statements.clear()
                start, start_cpu = time.perf_counter(), time.process_time()
                counts = await rec.pass_once(epoch)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
                per_pass.append(len(statements))
                assert not counts, f"not a no-op pass: {counts}"

        # The same passes with the cyclic GC off: how much of a pass is collections of a heap
        # the size of the fleet (the rows and views a pass builds are acyclic).
        nogc: list[float] = []
        for _ in range(reps):
            gc.collect()
            gc.disable()
            try:
                start_cpu = time.process_time()
                await rec.pass_once(epoch)
                nogc.append(time.process_time() - start_cpu)
            finally:
                gc.enable()

        # The halves as the pass runs them: with the cyclic GC paused (loop._cyclic_gc_paused),
        # else a collection landing in one half would be charged to it.
        load_t: list[float] = []
        load_cpu: list[float] = []
        cold_t: list[float] = []
        cold_cpu: list[float] = []
        plan_t: list[float] = []
        plan_cpu: list[float] = []
        for rep in range(2 * reps):
            # Odd reps: a new leader's first load, with no inventory remembered.
            cold = rep % 2 == 1
            if cold:
                reconcile_read._INVENTORIES.clear()
            now = datetime.now(UTC)
            gc.collect()
            gc.disable()
            try:
                async with sessions() as session, session.begin():
                    await check_epoch(session, epoch)
                    start, start_cpu = time.perf_counter(), time.process_time()
                    state = await load_snapshot(session, settings=SETTINGS, now=now)
                    (cold_t if cold else load_t).append(time.perf_counter() - start)
                    (cold_cpu if cold else load_cpu).append(time.process_time() - start_cpu)
                if cold:
                    continue
                start, start_cpu = time.perf_counter(), time.process_time()
                compute_plan(state.snapshot, now)
                plan_t.append(time.perf_counter() - start)
                plan_cpu.append(time.process_time() - start_cpu)
            finally:
                gc.enable()
    finally:
        await lock.release()
        await engine.dispose()
    return {
        "nodes": num_nodes,
        "gpus": num_nodes * 8,
        "deployments": num_nodes // 10 * 2,
        "replicas": replicas,
        "replicas_placed": created,
        "setup_s": round(setup_s, 2),
        "pass_ms_best": round(min(times) * 1e3, 2),
        "pass_ms_median": round(statistics.median(times) * 1e3, 2),
        "pass_cpu_ms_best": round(min(cpu) * 1e3, 2),
        "pass_cpu_ms_best_gc_off": round(min(nogc) * 1e3, 2),
        "load_ms_best": round(min(load_t) * 1e3, 2),
        "load_cpu_ms_best": round(min(load_cpu) * 1e3, 2),
        "load_cold_ms_best": round(min(cold_t) * 1e3, 2),
        "load_cold_cpu_ms_best": round(min(cold_cpu) * 1e3, 2),
        "plan_ms_best": round(min(plan_t) * 1e3, 2),
        "plan_cpu_ms_best": round(min(plan_cpu) * 1e3, 2),
        "statements_per_pass": sorted(set(per_pass)),
    }


async def _run(sizes: list[int], reps: int) -> dict[str, Any]:
    rows = []
    with EmbeddedPostgres(throwaway=True) as pg:
        for n in sizes:
            rows.append(await _measure(pg.admin_url, n, reps))
            print(json.dumps(rows[-1]), file=sys.stderr)  # progress: big fleets take a while
    out: dict[str, Any] = {"benchmark": "reconcile", "fleets": rows}
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        ratio = last["nodes"] / first["nodes"]
        out["growth_vs_linear"] = round(last["pass_ms_best"] / first["pass_ms_best"] / ratio, 3)
        out["statements_constant"] = len({tuple(r["statements_per_pass"]) for r in rows}) == 1
        by_size = {r["nodes"]: r for r in rows}
        for n in (1000, 10000):
            if n in by_size:
                out[f"nodes_{n}_under_1s"] = by_size[n]["pass_ms_best"] < 1000
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    out = asyncio.run(_run(args.sizes, args.reps))
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
