"""Agent sync throughput: many simulated agents syncing against one control plane process.

A throwaway Postgres (or --database-url), migrated; one control plane process serving the
agent API (uvicorn, one worker, uvloop + httptools); --nodes agents registered over HTTP,
one shard placed on each (as the reconciler would write it), one changed sync each to warm
up. Then two measured phases of UNCHANGED syncs (same desired_version, same bindings):

  closed  --concurrency requests in flight at all times: the process's capacity.
  paced   an open loop at --rate syncs/s (1,000 nodes every 2 s is 500/s): latency at the
          design's load, sent on schedule whether or not earlier ones returned.

Database writes are read from pg_stat_user_tables around the closed phase (after a pause
so every backend has flushed its counters): the heartbeat rows the batched flush wrote, and
every other insert/update/delete, which should be zero.

Prints one JSON object. Not a test: figures depend on the machine (the client runs on the
same cores as the server and Postgres).

    python bench/agent_sync.py [--nodes 1000] [--concurrency 64] [--seconds 10] [--rate 500]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmgw.protocol.sync import REGISTER_PATH, SYNC_PATH  # noqa: E402


def _serve(database_url: str, port: int) -> None:
    """The control plane process: only the agent API, as the internal listener mounts it."""
    import uvicorn
    from fastapi import FastAPI
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from starlette.responses import Response

    from llmgw.config import AgentApiSettings
    from llmgw.controlplane.agentapi.endpoints import install_agent_api
    from llmgw.controlplane.instances import InstanceIdentity
    from llmgw.logs import configure_logging
    from llmgw.store.database import create_engine, session_factory

    configure_logging("warning", json=True)
    engine = create_engine(database_url, pool_size=10)
    app = FastAPI()
    registry = CollectorRegistry()
    install_agent_api(
        app,
        settings=AgentApiSettings(),
        sessions=session_factory(engine),
        instance=InstanceIdentity("bench-cp", f"http://127.0.0.1:{port}"),
        registry=registry,
    )

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    profile_path = os.environ.get("LLMGW_BENCH_PROFILE", "")
    profiler = None
    if profile_path:  # where the server's time goes: cProfile, dumped at shutdown
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        workers=1,
        loop="uvloop",
        http="httptools",
        log_config=None,
        access_log=False,
        lifespan="on",
    )
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)


@contextlib.contextmanager
def _database(url: str | None) -> Iterator[str]:
    from llmgw.store.migrations import upgrade

    if url:
        upgrade(url)
        yield url
        return
    from llmgw.embedded_postgres import EmbeddedPostgres, create_database, drop_database

    with EmbeddedPostgres(throwaway=True) as pg:
        db = create_database(pg.admin_url, "agent_sync_bench")
        try:
            upgrade(db)
            yield db
        finally:
            drop_database(pg.admin_url, "agent_sync_bench")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _sql(url: str, statements: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    from sqlalchemy import CursorResult, text

    from llmgw.store.database import create_engine, session_factory

    engine = create_engine(url, pool_size=1)
    out: list[Any] = []
    try:
        async with session_factory(engine)() as s, s.begin():
            for sql, params in statements:
                r = cast(CursorResult[Any], await s.execute(text(sql), params))
                out.append(list(r) if r.returns_rows else None)
    finally:
        await engine.dispose()
    return out


async def _token(url: str) -> str:
    from llmgw.store.bootstrap_tokens import create_bootstrap_token
    from llmgw.store.database import create_engine, session_factory

    engine = create_engine(url, pool_size=1)
    try:
        async with session_factory(engine)() as s, s.begin():
            _, plaintext = await create_bootstrap_token(s, ttl_s=3600, uses=None)
    finally:
        await engine.dispose()
    return plaintext


async def _place_one_shard_each(url: str, node_ids: list[str]) -> dict[str, str]:
    """One sim shard per node on GPU 0, written as the reconciler does (one transaction)."""
    shard_of = {n: str(uuid.uuid4()) for n in node_ids}
    rows = [{"node": n, "shard": s, "replica": str(uuid.uuid4())} for n, s in shard_of.items()]
    spec = {"profile": {"name": "bench-sim", "engine": "sim", "model": "bench", "model_path": "x"}}
    await _sql(
        url,
        [
            ("INSERT INTO models (name) VALUES ('bench')", {}),
            (
                "INSERT INTO profiles (name, model_id, engine, gpu_class, model_path, "
                "kv_hash_seed, fingerprint) SELECT 'bench-sim', id, 'sim', 'sim', 'x', '42', "
                "'fp' FROM models",
                {},
            ),
            (
                "INSERT INTO deployments (name, model_id, profile_id) "
                "SELECT 'bench', model_id, id FROM profiles",
                {},
            ),
            (
                "INSERT INTO replicas (id, deployment_id, profile_fingerprint) "
                "SELECT (r->>'replica')::uuid, (SELECT id FROM deployments), 'fp' "
                "FROM jsonb_array_elements(CAST(:rows AS jsonb)) r",
                {"rows": json.dumps(rows)},
            ),
            (
                "INSERT INTO shards (id, replica_id, node_id, rank, launch_spec, "
                "profile_fingerprint, engine_api_key) SELECT (r->>'shard')::uuid, "
                "(r->>'replica')::uuid, (r->>'node')::uuid, 0, CAST(:spec AS jsonb), 'fp', 'k' "
                "FROM jsonb_array_elements(CAST(:rows AS jsonb)) r",
                {"rows": json.dumps(rows), "spec": json.dumps(spec)},
            ),
            (
                "INSERT INTO gpu_assignments (shard_id, position, node_id, gpu_index) "
                "SELECT (r->>'shard')::uuid, 0, (r->>'node')::uuid, 0 "
                "FROM jsonb_array_elements(CAST(:rows AS jsonb)) r",
                {"rows": json.dumps(rows)},
            ),
            ("UPDATE nodes SET desired_version = desired_version + 1", {}),
        ],
    )
    return shard_of


_STATS = "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables ORDER BY relname"


async def _write_stats(url: str) -> dict[str, tuple[int, int, int]]:
    (rows,) = await _sql(url, [(_STATS, {})])
    return {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}


async def _server_syncs(http: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """The server's own count of syncs by result (llmgw_agent_syncs_total)."""
    async with http.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("llmgw_agent_syncs_total{"):
            label = line.split('result="', 1)[1].split('"', 1)[0]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out


async def _server_buckets(http: aiohttp.ClientSession, base: str) -> dict[float, float]:
    """Cumulative counts of llmgw_agent_sync_seconds for unchanged syncs, by upper bound."""
    async with http.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("llmgw_agent_sync_seconds_bucket{") and 'result="unchanged"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def _bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> str:
    """The histogram bucket holding the q-quantile of what was observed in between."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = counts[-1][1] if counts else 0.0
    for le, n in counts:
        if total and n >= q * total:
            return f"<= {le * 1000:g} ms"
    return "n/a"


class _Agent:
    def __init__(self, node_id: str, credential: str, binding: str) -> None:
        self.node_id = node_id
        self.headers = {"Authorization": f"Bearer {credential}", "Content-Type": "application/json"}
        self.binding = binding
        self.seq = 0
        self.version: str | None = None

    def body(self) -> bytes:
        self.seq += 1
        version = "null" if self.version is None else f'"{self.version}"'
        return (
            f'{{"protocol_version":1,"node_id":"{self.node_id}","agent_epoch":1,'
            f'"seq":{self.seq},"desired_version":{version},"bindings":[{self.binding}]}}'
        ).encode()


async def _sync(http: aiohttp.ClientSession, base: str, agent: _Agent) -> dict[str, Any]:
    async with http.post(base + SYNC_PATH, data=agent.body(), headers=agent.headers) as r:
        if r.status != 200:
            raise RuntimeError(f"sync of {agent.node_id} answered {r.status}: {await r.text()}")
        out: dict[str, Any] = await r.json()
        return out


def _summary(latencies: list[float], elapsed: float, unchanged: int) -> dict[str, Any]:
    lat = sorted(latencies)
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [lat[0]] * 99
    return {
        "syncs": len(lat),
        "unchanged": unchanged,
        "seconds": round(elapsed, 2),
        "syncs_per_s": round(len(lat) / elapsed, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "max_ms": round(lat[-1] * 1000, 2),
    }


async def _closed(
    http: aiohttp.ClientSession, base: str, agents: list[_Agent], concurrency: int, seconds: float
) -> dict[str, Any]:
    latencies: list[float] = []
    unchanged = 0
    deadline = time.perf_counter() + seconds
    queue = list(agents)

    async def worker(i: int) -> None:
        nonlocal unchanged
        k = i
        while time.perf_counter() < deadline:
            agent = queue[k % len(queue)]
            k += concurrency
            t = time.perf_counter()
            resp = await _sync(http, base, agent)
            latencies.append(time.perf_counter() - t)
            unchanged += bool(resp["unchanged"])

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return _summary(latencies, time.perf_counter() - started, unchanged)


async def _paced(
    http: aiohttp.ClientSession, base: str, agents: list[_Agent], rate: float, seconds: float
) -> dict[str, Any]:
    latencies: list[float] = []
    unchanged = 0
    tasks: list[asyncio.Task[None]] = []

    async def one(agent: _Agent) -> None:
        nonlocal unchanged
        t = time.perf_counter()
        resp = await _sync(http, base, agent)
        latencies.append(time.perf_counter() - t)
        unchanged += bool(resp["unchanged"])

    started = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        due = started + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(agents[i % len(agents)])))
    await asyncio.gather(*tasks)
    return _summary(latencies, time.perf_counter() - started, unchanged)


async def _run(
    args: argparse.Namespace, url: str, base: str, server: subprocess.Popen[bytes]
) -> dict[str, Any]:
    if True:
        connector = aiohttp.TCPConnector(limit=max(args.concurrency, 256))
        async with aiohttp.ClientSession(connector=connector) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    async with http.post(base + SYNC_PATH, data=b"{}") as r:
                        if r.status == 401:
                            break
                except aiohttp.ClientError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the control plane process did not come up")
                await asyncio.sleep(0.1)

            token = await _token(url)
            sem = asyncio.Semaphore(16)

            async def register(i: int) -> tuple[str, str]:
                body = {
                    "bootstrap_token": token,
                    "node_name": f"bench-{i:05d}",
                    "mgmt_addr": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                    "inventory": {
                        "gpus": [
                            {"index": g, "name": "sim", "gpu_class": "sim", "simulated": True}
                            for g in range(8)
                        ]
                    },
                }
                async with sem, http.post(base + REGISTER_PATH, json=body) as r:
                    got = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"registration answered {r.status}: {got}")
                    return got["node_id"], got["node_credential"]

            t = time.perf_counter()
            registered = await asyncio.gather(*(register(i) for i in range(args.nodes)))
            register_s = time.perf_counter() - t
            shard_of = await _place_one_shard_each(url, [n for n, _ in registered])
            agents = [
                _Agent(
                    node,
                    cred,
                    json.dumps(
                        {
                            "shard_id": shard_of[node],
                            "observed_state": "ready",
                            "pid": 1000 + i,
                            "http_port": 20000,
                            "proxy_url": f"http://10.0.0.1:9401/shards/{shard_of[node]}",
                            "fingerprint": "fp",
                        },
                        separators=(",", ":"),
                    ),
                )
                for i, (node, cred) in enumerate(registered)
            ]

            async def warm(agent: _Agent) -> None:
                async with sem:
                    resp = await _sync(http, base, agent)
                agent.version = resp["desired_version"]
                assert resp["shards"] and len(resp["shards"]) == 1, resp

            t = time.perf_counter()
            await asyncio.gather(*(warm(a) for a in agents))
            warm_s = time.perf_counter() - t

            # A backend publishes its counters to pg_stat_user_tables at most once a second
            # while busy and within PGSTAT_IDLE_INTERVAL (10 s) once idle: wait that out.
            await asyncio.sleep(args.stats_pause_s)
            before = await _write_stats(url)
            results_before = await _server_syncs(http, base)
            closed = await _closed(http, base, agents, args.concurrency, args.seconds)
            results_after = await _server_syncs(http, base)
            await asyncio.sleep(args.stats_pause_s)
            after = await _write_stats(url)
            buckets_before = await _server_buckets(http, base)
            paced = await _paced(http, base, agents, args.rate, args.seconds)
            buckets_after = await _server_buckets(http, base)
            # In-handler time as the server measures it (excludes event-loop queueing and
            # the client): tells a slow handler from a starved process.
            paced["server_handler_p50"] = _bucket_quantile(buckets_before, buckets_after, 0.5)
            paced["server_handler_p99"] = _bucket_quantile(buckets_before, buckets_after, 0.99)

        delta = {
            t: tuple(a - b for a, b in zip(after[t], before.get(t, (0, 0, 0)), strict=True))
            for t in after
        }
        heartbeat_rows = delta.get("node_status", (0, 0, 0))[1]
        # This instance's own row in controlplane_instances beats every few seconds whatever
        # the agents do: reported, not charged to syncs.
        instance_beats = sum(delta.get("controlplane_instances", (0, 0, 0)))
        other = {
            t: d
            for t, d in delta.items()
            if any(d) and t not in ("node_status", "controlplane_instances")
        }
        other_writes = (
            sum(sum(d) for d in other.values()) + sum(delta["node_status"]) - heartbeat_rows
        )
        server_results = {k: v - results_before.get(k, 0.0) for k, v in results_after.items()}
        syncs = closed["syncs"]
        return {
            "bench": "agent_sync",
            "nodes": args.nodes,
            "register_s": round(register_s, 2),
            "registrations_per_s": round(args.nodes / register_s, 1),
            "warmup_changed_syncs_per_s": round(args.nodes / warm_s, 1),
            "closed": {
                "concurrency": args.concurrency,
                **closed,
                "server_results": server_results,
            },
            "paced": {"target_per_s": args.rate, **paced},
            "db": {
                "heartbeat_rows": heartbeat_rows,
                "heartbeat_rows_per_unchanged_sync": round(heartbeat_rows / syncs, 4),
                "other_writes": other_writes,
                "other_writes_per_unchanged_sync": round(other_writes / syncs, 6),
                "other_tables_written": {t: d for t, d in sorted(other.items())},
                "instance_heartbeat_writes": instance_beats,
            },
            "targets": {
                "syncs_per_s_min": 500,
                "p99_ms_max": 50,
                "closed_syncs_per_s_ok": closed["syncs_per_s"] >= 500,
                "paced_p99_ok": paced["p99_ms"] < 50,
                "no_other_writes": other_writes == 0,
            },
            "note": "client, server and Postgres share this machine's cores; Postgres runs "
            "with fsync off when throwaway",
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--stats-pause-s", type=float, default=11.0)
    p.add_argument("--database-url", default=os.environ.get("LLMGW_BENCH_DATABASE_URL", ""))
    p.add_argument("--serve", nargs=2, metavar=("URL", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        _serve(args.serve[0], int(args.serve[1]))
        return
    with _database(args.database_url or None) as url:
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", url, str(port)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            result = asyncio.run(_run(args, url, f"http://127.0.0.1:{port}", server))
        finally:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
