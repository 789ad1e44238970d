"""Benchmark: what the gateway adds on the request path, against the floor, in one run.

Three ways to reach one canned OpenAI upstream (bench/_servers.py ``canned``: a fixed
completion, streamed as N chunks or not, under uvicorn + uvloop; not the simulator, whose own
cost would drown the proxy's):

- ``direct``: the client talks to the upstream;
- ``floor``: through the minimal pass-through proxy (bench/_servers.py ``floor``: raw ASGI
  under uvicorn + uvloop, one pooled aiohttp client), and the same with an httpx client
  (``floor_httpx``): the measurement the gateway's upstream client is chosen by;
- ``gateway``: through `llmgw controlplane`'s public listener, with an API key and
  ``gateway.routing_policy = least_loaded``.

How the gateway reaches the canned upstream: through the control plane's own route table,
fed the way every replica is. A deployment of one `sim` replica is declared through the
admin API; a *stub agent* in this process registers a node (bootstrap token, one simulated
GPU) over the real agent protocol, receives the shard the reconciler places on it, and keeps
reporting it ``ready`` every 0.5 s with ``proxy_url`` pointing at the canned app (which then
demands that shard's engine key, like an agent's proxy). Chosen over inserting rows into
Postgres: the rows' invariants (GPU assignments, leader ports, desired versions, the node's
sync heartbeat the reconciler judges liveness by) stay the control plane's to write, so the
bench cannot drift from the schema or have its replica replaced as a dead node's.

Per target, at 1 and 32 concurrent clients, streaming and not: latency p50/p99 and the
added latency against ``direct`` (p50 of the target minus p50 direct, same for p99), time
to first token, requests/s, and the proxy process's CPU per request and per streamed chunk
(/proc/<pid>/task/*/schedstat before and after the phase; the gateway's idle CPU over the
same wall time, measured first, is subtracted). A last phase streams chunks
``--interval-ms`` apart at one client and reports when each arrived: a proxy that buffers
delivers them all at the end.

    .venv/bin/python bench/gateway.py --requests 2000 --chunks 16

Prints one JSON object. The gateway's targets: at 32 clients >= 60% of the floor's
requests/s; at one client added p50 <= 1.5 ms; chunks pass through unbuffered.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    ControlPlane,
    Result,
    Stack,
    base_env,
    cpu_seconds,
    free_port,
    post,
    summarize,
    wait_for,
)

__all__ = ["StubAgent", "main"]

MODEL = "canned"
SERVERS = str(Path(__file__).resolve().parent / "_servers.py")
TARGET_RPS_SHARE = 0.60
TARGET_ADDED_P50_MS = 1.5


class StubAgent:
    """A node agent reduced to the protocol: registers, syncs, reports one upstream ready.

    It runs no engine: every running leader shard the control plane gives it is reported
    ``ready`` with ``proxy_url`` = the canned upstream's URL under ``/shards/<id>``.
    """

    def __init__(self, cp_url: str, token: str, upstream: str) -> None:
        self.cp_url = cp_url
        self.token = token
        self.upstream = upstream
        self.ready = False
        self.keys: dict[str, str] = {}
        self._desired: list[Any] = []
        self._version: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = httpx.Client(timeout=5)
        self._epoch = int(time.time() * 1000)
        # Fixed, as an agent reports it: a start time new on every sync would make every sync
        # a change the control plane writes.
        self._started_at = time.time()
        self._seq = 0
        self.node_id = ""
        self._credential = ""
        self.error: BaseException | None = None

    def register(self) -> None:
        from llmgw.protocol.sync import (
            REGISTER_PATH,
            GpuDevice,
            NodeInventory,
            RegisterRequest,
            RegisterResponse,
        )

        self._inventory = NodeInventory(
            gpus=(
                GpuDevice(index=0, uuid="GPU-bench-0", name="sim", gpu_class="sim", simulated=True),
            ),
            cpu_threads=os.cpu_count() or 1,
            source="sim",
        )
        req = RegisterRequest(
            bootstrap_token=self.token,
            node_name=f"bench-{uuid.uuid4().hex[:6]}",
            mgmt_addr="127.0.0.1",
            inventory=self._inventory,
            agent_version="bench",
        )
        r = self._client.post(self.cp_url + REGISTER_PATH, content=req.model_dump_json())
        r.raise_for_status()
        resp = RegisterResponse.model_validate_json(r.content)
        self.node_id, self._credential = resp.node_id, resp.node_credential

    def bindings(self) -> tuple[Any, ...]:
        """What each sync reports: every running leader ready at the canned upstream."""
        from llmgw.protocol.sync import ShardBinding

        return tuple(
            ShardBinding(
                shard_id=d.shard_id,
                observed_state="ready",
                pid=os.getpid(),
                http_port=int(self.upstream.rsplit(":", 1)[1]),
                proxy_url=f"{self.upstream}/shards/{d.shard_id}",
                engine_version="canned",
                fingerprint=d.fingerprint,
                started_at=self._started_at,
            )
            for d in self._desired
            if self.ready and d.rank == 0 and d.desired_state == "running"
        )

    def sync_once(self) -> None:
        from llmgw.protocol.sync import SYNC_PATH, SyncRequest, SyncResponse

        self._seq += 1
        bindings = self.bindings()
        req = SyncRequest(
            node_id=self.node_id,
            agent_epoch=self._epoch,
            seq=self._seq,
            desired_version=self._version,
            bindings=bindings,
            inventory=self._inventory if self._seq == 1 else None,
        )
        r = self._client.post(
            self.cp_url + SYNC_PATH,
            content=req.model_dump_json(),
            headers={"Authorization": f"Bearer {self._credential}"},
        )
        r.raise_for_status()
        resp = SyncResponse.model_validate_json(r.content)
        if resp.shards is not None:
            self._desired = list(resp.shards)
            self.keys = {d.shard_id: d.engine_api_key for d in resp.shards}
        self._version = resp.desired_version

    def start_loop(self, period_s: float = 2.0) -> None:
        def loop() -> None:
            while not self._stop.wait(period_s):
                try:
                    self.sync_once()
                except Exception as exc:  # reported by the bench, which stops on it
                    self.error = exc

        self._thread = threading.Thread(target=loop, name="stub-agent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._client.close()


def _body(stream: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _load(
    url: str,
    headers: dict[str, str],
    *,
    concurrency: int,
    requests: int,
    stream: bool,
    chunks: int,
) -> tuple[list[Result], float]:
    """``requests`` requests over ``concurrency`` persistent client connections."""
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    results: list[Result] = []
    body = _body(stream, chunks)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm-up: connections opened, caches filled, before anything is timed.
        await asyncio.gather(*(post(session, url, body, headers) for _ in range(concurrency * 2)))
        left = requests

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                results.append(await post(session, url, body, headers))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


@dataclass
class _Tally:
    """One target in one phase, summed over the rounds."""

    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    busy_cpu_s: float = 0.0
    cpu_requests: int = 0


def _round(
    tally: _Tally,
    name: str,
    url: str,
    headers: dict[str, str],
    pid: int | None,
    idle_cpu_per_s: float,
    *,
    concurrency: int,
    requests: int,
    stream: bool,
    chunks: int,
) -> None:
    cpu0 = cpu_seconds(pid) if pid else 0.0
    t0 = time.perf_counter()
    results, wall = asyncio.run(
        _load(
            url, headers, concurrency=concurrency, requests=requests, stream=stream, chunks=chunks
        )
    )
    span = time.perf_counter() - t0
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} of {len(results)} failed, e.g. {failed[0]}")
    tally.results += results
    tally.wall_s += wall
    if pid:
        # The warm-up is inside the CPU window: its requests are counted too. Background work
        # of the process (a control plane's loops), at its idle rate, is not.
        cpu = cpu_seconds(pid) - cpu0
        tally.busy_cpu_s += max(cpu - idle_cpu_per_s * span, 0.0)
        tally.cpu_requests += len(results) + concurrency * 2


def _summary(tally: _Tally, *, stream: bool, chunks: int, measured_cpu: bool) -> dict[str, Any]:
    results = tally.results
    out: dict[str, Any] = {
        "requests": len(results),
        "wall_s": round(tally.wall_s, 3),
        "requests_per_s": round(len(results) / tally.wall_s, 1),
        "latency_ms": summarize([r.latency_s for r in results]),
    }
    if stream:
        out["ttft_ms"] = summarize([r.ttft_s for r in results if r.ttft_s is not None])
    if measured_cpu:
        n = tally.cpu_requests
        out["proxy_cpu_us_per_request"] = round(tally.busy_cpu_s / n * 1e6, 1)
        if stream:
            # Content chunks plus the role chunk and the usage chunk.
            out["proxy_cpu_us_per_chunk"] = round(tally.busy_cpu_s / (n * (chunks + 2)) * 1e6, 2)
    return out


async def _chunk_timing(url: str, headers: dict[str, str], chunks: int) -> list[float]:
    async with aiohttp.ClientSession() as session:
        r = await post(session, url, _body(True, chunks), headers, keep_chunk_times=True)
    if not r.ok:
        raise RuntimeError(f"chunk timing via {url}: {r}")
    return [round(t * 1e3, 2) for t in r.chunk_times]


def _idle_cpu_per_s(pid: int, seconds: float = 2.0) -> float:
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)


def _setup_gateway(stack: Stack, canned_port: int) -> tuple[ControlPlane, StubAgent, str, str]:
    """Postgres, the control plane, a deployment, the stub agent, an API key.

    Returns (control plane, stub agent, engine key of the shard, API key).
    """
    stack.start_postgres()
    # The control plane's own periods and log level, not the harness's short ones: a pass of
    # the reconciler every 0.5 s (and the agent API's heartbeat writes) would be background
    # work no production gateway carries, measured as if the gateway's; the access log line
    # at `info` is work every production request pays.
    cp = stack.controlplane(
        "controlplane",
        short_periods=False,
        LLMGW_GATEWAY__ROUTING_POLICY="least_loaded",
        LLMGW_LOG__LEVEL="info",
    )
    cp.sim_deployment(MODEL, replicas=1)
    token = cp.admin("POST", "/bootstrap-tokens", {"pool": "default", "uses": 1})["token"]
    agent = StubAgent(cp.url, token, f"http://127.0.0.1:{canned_port}")
    agent.register()

    def placed() -> bool:
        agent.sync_once()
        return bool(agent.keys)

    wait_for(placed, timeout_s=60, what="the reconciler to place the canned replica")
    engine_key = next(iter(agent.keys.values()))
    agent.ready = True
    agent.sync_once()
    agent.start_loop()
    api_key = cp.create_key()
    return cp, agent, engine_key, api_key


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-gw-"))
    stack = Stack(tmp)
    agent: StubAgent | None = None
    try:
        canned_port = free_port()
        # The canned upstream starts once the reconciler has made the shard's engine key,
        # which it then demands; the stub agent already names its URL.
        cp, agent, engine_key, api_key = _setup_gateway(stack, canned_port)
        # The key in the environment, never on argv (where `ps` shows it).
        env = base_env(CANNED_API_KEY=engine_key)
        canned = stack.spawn(
            "canned",
            [sys.executable, SERVERS, "canned", "--port", str(canned_port),
             "--chunks", str(args.chunks)],
            env,
        )  # fmt: skip
        direct_url = f"http://127.0.0.1:{canned_port}"
        wait_for(
            lambda: httpx.get(direct_url + "/health", timeout=1).status_code == 200,
            timeout_s=30, what="the canned upstream", check=canned.check,
        )  # fmt: skip
        floors: dict[str, tuple[str, int]] = {}
        for client in ("aiohttp", "httpx"):
            port = free_port()
            p = stack.spawn(
                f"floor-{client}",
                [sys.executable, SERVERS, "floor", "--port", str(port),
                 "--upstream", direct_url, "--client", client],
                env,
            )  # fmt: skip
            u = f"http://127.0.0.1:{port}"
            wait_for(
                lambda u=u: httpx.get(u + "/health", timeout=1).status_code == 200,  # type: ignore[misc]
                timeout_s=30, what=f"the {client} floor", check=p.check,
            )  # fmt: skip
            floors["floor" if client == "aiohttp" else "floor_httpx"] = (u, p.pid)

        gw_headers = {"Authorization": f"Bearer {api_key}"}
        gw_chat = cp.public_url + "/v1/chat/completions"
        # The same gateway as `llmgw gateway` processes apart from the control plane, one
        # target per --gateway-workers count, reading the same database (keys, routes).
        procs: dict[str, tuple[str, int | None]] = {}
        for n in args.gateway_workers:
            port = free_port()
            p = stack.spawn(
                f"gateway-w{n}",
                [sys.executable, "-m", "llmgw", "gateway", "--port", str(port),
                 "--workers", str(n)],
                base_env(
                    LLMGW_CONTROLPLANE__DATABASE_URL=stack.db_url,
                    LLMGW_GATEWAY__ROUTING_POLICY="least_loaded",
                    LLMGW_LOG__LEVEL="info",
                ),
            )  # fmt: skip
            # CPU is read from one process: a lone worker's (several are children of it).
            procs[f"gateway_proc_w{n}"] = (
                f"http://127.0.0.1:{port}/v1/chat/completions",
                p.pid if n == 1 else None,
            )

        def gateway_serves() -> bool:
            if agent is not None and agent.error is not None:
                raise RuntimeError(f"stub agent: {agent.error!r}")
            r = httpx.post(gw_chat, json=_body(False, 4), headers=gw_headers, timeout=5)
            return r.status_code == 200

        wait_for(gateway_serves, timeout_s=60, what="the gateway to route to the canned upstream",
                 check=stack.check)  # fmt: skip
        for name, (url, _) in procs.items():
            wait_for(
                lambda url=url: httpx.post(  # type: ignore[misc]
                    url, json=_body(False, 4), headers=gw_headers, timeout=5
                ).status_code == 200,
                timeout_s=60, what=f"{name} to route", check=stack.check,
            )  # fmt: skip

        engine_headers = {"Authorization": f"Bearer {engine_key}"}
        targets: dict[str, tuple[str, dict[str, str], int | None]] = {
            "direct": (direct_url + "/v1/chat/completions", engine_headers, None),
            "floor": (
                floors["floor"][0] + "/v1/chat/completions",
                engine_headers,
                floors["floor"][1],
            ),
            "floor_httpx": (
                floors["floor_httpx"][0] + "/v1/chat/completions",
                engine_headers,
                floors["floor_httpx"][1],
            ),
            "gateway": (gw_chat, gw_headers, cp.pid),
            **{name: (url, gw_headers, pid) for name, (url, pid) in procs.items()},
        }
        idle = {
            name: _idle_cpu_per_s(pid, 1.0) if pid else 0.0 for name, (_, _, pid) in targets.items()
        }
        phases: dict[str, dict[str, Any]] = {}
        for stream in (False, True):
            for conc in args.concurrency:
                key = f"{'stream' if stream else 'plain'}_c{conc}"
                n = args.requests if conc > 1 else args.requests_single
                names = [t for t in targets if not (t == "floor_httpx" and conc == 1)]
                tallies = {t: _Tally() for t in names}
                # Rounds, each target in turn (rotating who goes first): load from other
                # processes on the machine falls on every target alike, not on one phase.
                for r in range(args.rounds):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        url, headers, pid = targets[name]
                        stack.check()
                        _round(
                            tallies[name], name, url, headers, pid, idle[name],
                            concurrency=conc, requests=max(n // args.rounds, conc),
                            stream=stream, chunks=args.chunks,
                        )  # fmt: skip
                phases[key] = {
                    t: _summary(
                        tallies[t],
                        stream=stream,
                        chunks=args.chunks,
                        measured_cpu=targets[t][2] is not None,
                    )
                    for t in names
                }
                _added(phases[key], stream)

        # Unbuffered chunks: a canned upstream pacing its chunks, one client.
        paced_port = free_port()
        paced = stack.spawn(
            "canned-paced",
            [sys.executable, SERVERS, "canned", "--port", str(paced_port),
             "--chunks", str(args.timing_chunks), "--chunk-interval-ms", str(args.interval_ms)],
            env,
        )  # fmt: skip
        paced_url = f"http://127.0.0.1:{paced_port}"
        wait_for(lambda: httpx.get(paced_url + "/health", timeout=1).status_code == 200,
                 timeout_s=30, what="the paced canned upstream", check=paced.check)  # fmt: skip
        direct_times = asyncio.run(
            _chunk_timing(paced_url + "/v1/chat/completions", engine_headers, args.timing_chunks)
        )
        # The gateway still routes to the first upstream: swap the stub agent's proxy_url.
        agent.upstream = paced_url
        # Paced or not shows in when the last chunk arrives, buffered or not.
        paced_total_ms = 0.8 * args.interval_ms * args.timing_chunks
        wait_for(
            lambda: asyncio.run(_chunk_timing(gw_chat, gw_headers, args.timing_chunks))[-1]
            >= paced_total_ms,
            timeout_s=30, what="the gateway to pick up the paced upstream's proxy_url",
        )  # fmt: skip
        gw_times = asyncio.run(_chunk_timing(gw_chat, gw_headers, args.timing_chunks))
        timing = _timing_report(direct_times, gw_times, args.interval_ms)
        return _report(args, phases, timing)
    finally:
        if agent is not None:
            agent.stop()
        stack.close(failed=sys.exc_info()[0] is not None)


def _added(phase: dict[str, Any], stream: bool) -> None:
    """Latency and TTFT each target adds over ``direct``, in ms."""
    base = phase["direct"]
    for name, m in phase.items():
        if name == "direct":
            continue
        m["added_latency_ms"] = {
            q: round(m["latency_ms"][q] - base["latency_ms"][q], 3) for q in ("p50", "p99")
        }
        if stream:
            m["added_ttft_ms"] = {
                q: round(m["ttft_ms"][q] - base["ttft_ms"][q], 3) for q in ("p50", "p99")
            }


def _timing_report(direct: list[float], gateway: list[float], interval_ms: float) -> dict[str, Any]:
    def gaps(ts: list[float]) -> list[float]:
        return [round(b - a, 2) for a, b in itertools.pairwise(ts)]

    g = gaps(gateway)
    # Buffering shows as gaps near zero followed by one long wait; unbuffered, the median gap
    # is the upstream's pacing.
    median_gap = sorted(g)[len(g) // 2] if g else 0.0
    return {
        "upstream_interval_ms": interval_ms,
        "direct_chunk_arrival_ms": direct,
        "gateway_chunk_arrival_ms": gateway,
        "gateway_median_gap_ms": median_gap,
        "unbuffered": bool(g) and median_gap >= 0.5 * interval_ms,
    }


def _report(
    args: argparse.Namespace, phases: dict[str, dict[str, Any]], timing: dict[str, Any]
) -> dict[str, Any]:
    hi = max(args.concurrency)
    lo = min(args.concurrency)
    rps_share = {
        kind: round(
            phases[f"{kind}_c{hi}"]["gateway"]["requests_per_s"]
            / phases[f"{kind}_c{hi}"]["floor"]["requests_per_s"],
            3,
        )
        for kind in ("plain", "stream")
    }
    added_p50 = {
        kind: phases[f"{kind}_c{lo}"]["gateway"]["added_latency_ms"]["p50"]
        for kind in ("plain", "stream")
    }
    client_cmp = {
        kind: {
            "aiohttp_rps": phases[f"{kind}_c{hi}"]["floor"]["requests_per_s"],
            "httpx_rps": phases[f"{kind}_c{hi}"]["floor_httpx"]["requests_per_s"],
            "aiohttp_cpu_us_per_request": phases[f"{kind}_c{hi}"]["floor"][
                "proxy_cpu_us_per_request"
            ],
            "httpx_cpu_us_per_request": phases[f"{kind}_c{hi}"]["floor_httpx"][
                "proxy_cpu_us_per_request"
            ],
        }
        for kind in ("plain", "stream")
    }
    # The gateway as processes of its own: requests/s at the most clients against the floor
    # and against the gateway inside the control plane.
    separate = {
        name: {
            kind: {
                "requests_per_s": phases[f"{kind}_c{hi}"][name]["requests_per_s"],
                "share_of_floor": round(
                    phases[f"{kind}_c{hi}"][name]["requests_per_s"]
                    / phases[f"{kind}_c{hi}"]["floor"]["requests_per_s"],
                    3,
                ),
                "ratio_to_in_process": round(
                    phases[f"{kind}_c{hi}"][name]["requests_per_s"]
                    / phases[f"{kind}_c{hi}"]["gateway"]["requests_per_s"],
                    3,
                ),
                "latency_p50_ms_at_one_client": phases[f"{kind}_c{lo}"][name]["latency_ms"]["p50"],
            }
            for kind in ("plain", "stream")
        }
        for name in phases[f"plain_c{hi}"]
        if name.startswith("gateway_proc_")
    }
    return {
        "bench": "gateway",
        "gateway_processes": separate,
        "routing_policy": "least_loaded",
        "chunks": args.chunks,
        "cpu_count": os.cpu_count(),
        "phases": phases,
        "chunk_timing": timing,
        "upstream_client_at_32": client_cmp,
        "targets": {
            "rps_share_of_floor_at_max_clients": rps_share,
            "rps_share_target": TARGET_RPS_SHARE,
            "added_p50_ms_at_one_client": added_p50,
            "added_p50_target_ms": TARGET_ADDED_P50_MS,
            "meets_rps": all(v >= TARGET_RPS_SHARE for v in rps_share.values()),
            "meets_added_p50": all(v <= TARGET_ADDED_P50_MS for v in added_p50.values()),
            "meets_unbuffered": timing["unbuffered"],
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="per phase at >1 client")
    parser.add_argument("--requests-single", type=int, default=500, help="per phase at 1 client")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=4, help="each phase split in rounds")
    parser.add_argument("--chunks", type=int, default=16, help="content chunks per stream")
    parser.add_argument("--timing-chunks", type=int, default=10)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument(
        "--gateway-workers",
        type=int,
        nargs="*",
        default=[],
        help="also measure `llmgw gateway --workers N` apart from the control plane, per N",
    )
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    from llmgw.logs import configure_logging

    # Logs to stderr, warnings only: stdout carries the JSON report alone.
    configure_logging("warning")
    main()
