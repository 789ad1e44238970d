"""Benchmark: runtime LoRA adapters on a small fleet, three ways of deciding where they load.

Issue [lora] item 6. Real processes on loopback: four `llmgw simengine` replicas, each holding
at most ``--slots`` (8) adapters at once (``--max-cpu-loras``: vLLM's held cache, least
recently used evicted past it; an evicted adapter stays registered and the next step that uses
it reads it back, stalling that step, and so the whole batch, ``--lora-load-time-s``), serving
``--adapters`` (60) adapters of one base model. Every arm replays the same seeded trace from a
cold start (no adapter loaded anywhere):

- Poisson arrivals at ``--rate`` requests/s for ``--duration-s``; each request a streamed chat
  for one adapter drawn Zipf(``--zipf-s``) over the adapters, its prompt the adapter's own
  system prompt (``--prefix-words`` words, the same for every request of that adapter, so the
  engine's prefix cache can serve it: block hashes include the adapter's name and path, as
  vLLM's do) plus a question of its own (``--question-words``), ``--max-tokens`` out;
- halfway through, the Zipf ranking is reshuffled: demand shifts to other adapters.

The arms:

(a) ``engine_lru``: what an engine alone does. The bench is the router: least-loaded (fewest
    requests in flight from this bench, ties in turn) across the four engines; before a
    request for adapter X goes to engine r, if r has not registered X the bench calls
    ``POST /v1/load_lora_adapter`` and the request waits for it (load on first use). From then
    on the engine's own LRU evicts and re-reads under its 8 slots.
(b) ``rendezvous``: rendezvous top-1 without demand: every request for X goes to X's
    highest-random-weight engine (blake2b of adapter and replica, llmgw's hash), loading on
    first use there. 60 adapters over 4 engines is 15 each: the LRU still evicts.
(c) ``llmgw``: the product. A throwaway Postgres, ``llmgw controlplane`` (gateway on its
    public port), ``llmgw agent --sim-gpus 4``; one apply of a model, a ``sim`` profile with
    ``adapter_slots: 8`` (its args carry the same simulator flags), a deployment of 4 replicas
    and the 60 ``kind: adapter`` documents (directories the bench creates); requests go through
    the gateway with an API key. The leader places adapters by demand, the agent loads and
    unloads them, the gateway routes to a replica that reports the adapter loaded and holds a
    request for an adapter loaded nowhere until one does.

Measured per arm, over the arrival window (events after it, in the drain, are not counted):

- TTFT p50/p90 (ms, wall) from the request's scheduled arrival to its first content chunk,
  so a router's wait for a load and the gateway's hold are in it; only answered requests
  (failures are counted apart, and ``ttft_ms_p90_failed_as_inf`` ranks them last);
- loads/min: adapter reads into an engine, from the engines' own log lines, the same source
  in every arm: runtime loads (``lora_adapter_loading``) plus re-reads of evicted adapters
  inside a step (``lora_adapters_reloaded``). Cross-checked against the bench's own calls in
  (a)/(b) and the agent's ``llmgw_agent_adapter_loads_total`` in (c). The simulator exposes no
  counter of re-reads; its log lines are the only record, so its log level is info.
  ``repeat/min``: the reads of an adapter into an engine that had read it before (a re-read
  after an eviction, or a load after an unload): the thrash part, beside the first loads;
- evictions/min: adapters the engines' LRU dropped (what a re-read pays for later): reads
  minus what each engine holds at the end (min(slots, distinct adapters it read)): the
  simulator also evicts, unlogged, in ``trim`` when a batch held more adapters than its slots;
  the logged count is in the JSON too;
- unload calls/min: ``/v1/unload_lora_adapter`` calls: none in (a)/(b), the agent's
  ``llmgw_agent_adapter_unloads_total`` in (c). vLLM's unload (and the simulator's) only
  unregisters the name: the adapter stays in the held cache until the LRU evicts it, so an
  unload frees no slot by itself and a swap counts one unload call and one eviction;
- prefix hit rate: sum(usage.prompt_tokens_details.cached_tokens) / sum(prompt_tokens);
- held: requests that waited for a load before being sent: in (a)/(b) those that waited on
  the bench's load call, in (c) the gateway's ``llmgw_gateway_adapter_held_answered_total``
  (by outcome: loaded, timeout, failed, gone);
- errors: requests not answered (status and the first error).

Printed: one table row per arm and the ratios of (b) and (c) to (a); the issue's acceptance:
llmgw's TTFT p90 <= 0.7x (a)'s and loads/min <= 0.3x (a)'s. JSON to ``--json``, a chart
(TTFT CDF per arm, reads per 10 s over time, TTFT p90 per 15 s over time) to ``--png``.

Timing. ``--lora-load-time-s 0.5`` (wall, not scaled): a rank-16..64 adapter of an 8-70B
model is 50-800 MB of safetensors; vLLM reads it from local disk, builds its tensors and
copies them to the GPU in roughly 0.2-1 s. ``--time-scale 3``: the simulator's default step
costs (2 ms a step, 0.05 ms a prefill token, 0.3 ms a decoding sequence) times 3 is about an
8B model on one H100 at small batches (a decode step ~7 ms; ~7k prefill tokens/s), so one load
is ~70 decode steps, and this 2-core machine carries four engines, a control plane, an agent
and the client at ``--rate 4``. The KV cache (``--num-blocks`` 1024 x 16 tokens a replica) is
sized so that every adapter's system prompt (~60 x 500 tokens) does not fit on one replica
while a quarter of them does: spreading every adapter everywhere costs prefix hits, keeping
each on one replica does not.

Caveats:

- (c) runs the control plane and agent at their production periods (reconcile tick 2 s,
  agent sync 2 s), which is what a held request's wait is made of (the pass, the agent's next
  sync, the load, the sync after it that reports it loaded). ``--short-periods`` uses the
  other benches' 0.5 s instead. The leader's placement knobs are its defaults
  (``AdapterPlacementConfig``: 8 req/s or 16 concurrent per holder, idle after 600 s, keep
  margin 1, displace at 2x less demand); the control plane reads none from its settings;
- (a)/(b) route from the client process (no proxy hop); (c) pays the gateway and the agent's
  proxy on the same two cores, so its TTFT carries that overhead too;
- the simulator never evicts an adapter a running request uses and refuses a load when all
  held adapters are busy (503; vLLM would evict and re-read instead): the bench's router
  retries such a load every 0.25 s (counted as ``load_refused``), the agent with its backoff;
- one run per arm, on a shared 2-core machine: percentiles of a few hundred requests move by
  10-20 % from run to run.

    # docs/bench/adapters.{json,png}: the defaults, 475 s on the shared 2-core machine
    .venv/bin/python bench/adapters.py
    .venv/bin/python bench/adapters.py --arms engine_lru llmgw --duration-s 60
    .venv/bin/python bench/adapters.py --arms llmgw --short-periods --json /tmp/a.json --png ""
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    ROOT,
    ControlPlane,
    Stack,
    base_env,
    free_port,
    percentile,
    post,
    wait_for,
)

__all__ = ["main", "make_trace", "rendezvous_top1"]

MODEL = "base"
ARMS = ("engine_lru", "rendezvous", "llmgw")
TARGET_TTFT_P90_RATIO = 0.7
TARGET_LOADS_RATIO = 0.3
_ALPHA = "abcdefghijklmnopqrstuvwxyz"


# --- the trace ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Req:
    at: float  # seconds from the start of the replay
    adapter: int  # index into the adapters
    phase: int  # 0 before the shift, 1 after
    rank: int  # the adapter's demand rank in its phase (1 = most asked for)
    seed: int  # the question's words


def _zipf_cum(n: int, s: float) -> list[float]:
    acc, out = 0.0, []
    for k in range(1, n + 1):
        acc += k**-s
        out.append(acc)
    return out


def make_trace(args: argparse.Namespace) -> tuple[list[Req], list[list[int]]]:
    """The requests and, per phase, the adapters in demand order (rank 1 first)."""
    rng = random.Random(args.seed)
    n = args.adapters
    ranking0 = list(range(n))
    rng.shuffle(ranking0)
    ranking1 = list(ranking0)
    rng.shuffle(ranking1)
    rankings = [ranking0, ranking1]
    cum = _zipf_cum(n, args.zipf_s)
    ranks = list(range(1, n + 1))
    out: list[Req] = []
    t = 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration_s:
            return out, rankings
        phase = 0 if t < args.duration_s * args.shift_at else 1
        rank = rng.choices(ranks, cum_weights=cum)[0]
        out.append(Req(t, rankings[phase][rank - 1], phase, rank, rng.getrandbits(32)))


def adapter_name(i: int) -> str:
    return f"lora-{i:02d}"


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(_ALPHA) for _ in range(rng.randint(2, 3))) for _ in range(n))


def messages_for(req: Req, args: argparse.Namespace) -> list[dict[str, str]]:
    system = f"You are {adapter_name(req.adapter)}. " + _words(
        random.Random(1000 + req.adapter), args.prefix_words
    )
    question = _words(random.Random(req.seed), args.question_words)
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _body(req: Req, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": adapter_name(req.adapter),
        "messages": messages_for(req, args),
        "max_tokens": args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }


def rendezvous_top1(adapter: str, replicas: list[str]) -> int:
    """Index of ``adapter``'s highest-random-weight replica: llmgw's hash
    (planner/adapter_placement._score, copied so the bench does not import a private name)."""

    def score(rid: str) -> int:
        digest = hashlib.blake2b(
            adapter.encode() + b"\0" + rid.encode(), digest_size=8, person=b"llmgw-adapter"
        ).digest()
        return int.from_bytes(digest, "big")

    return max(range(len(replicas)), key=lambda i: (score(replicas[i]), replicas[i]))


# --- one request, as any arm sends it ------------------------------------------------------


@dataclass
class Outcome:
    req: Req
    ok: bool = False
    status: int = 0
    ttft_s: float | None = None  # from the scheduled arrival
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    held: bool = False
    replica: int | None = None
    error: str = ""


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    req: Req,
    args: argparse.Namespace,
    arrival: float,
    headers: dict[str, str] | None = None,
) -> Outcome:
    out = Outcome(req)
    started = time.perf_counter()
    res = await post(session, url, _body(req, args), headers)
    waited = started - arrival
    out.ok, out.status, out.error = res.ok and res.ttft_s is not None, res.status, res.error
    out.latency_s = waited + res.latency_s
    if res.ttft_s is not None:
        out.ttft_s = waited + res.ttft_s
    if res.ok and res.ttft_s is None and not out.error:
        out.error = "stream had no content"
    if res.usage:
        out.prompt_tokens = int(res.usage.get("prompt_tokens") or 0)
        details = res.usage.get("prompt_tokens_details") or {}
        out.cached_tokens = int(details.get("cached_tokens") or 0)
    return out


async def _replay(
    trace: list[Req],
    send: Callable[[aiohttp.ClientSession, Req, float], Coroutine[Any, Any, Outcome]],
) -> tuple[list[Outcome], float]:
    """Send every request at its time; returns the outcomes and the replay's start (epoch s)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        wall0 = time.time()
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[Outcome]] = []
        for req in trace:
            delay = t0 + req.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(session, req, t0 + req.at)))
        outcomes = await asyncio.gather(*tasks)
    return list(outcomes), wall0


# --- arms (a) and (b): the bench routes, the engines load on first use --------------------


def _sim_flags(args: argparse.Namespace) -> list[str]:
    """Simulator flags every arm's engines get (the profile's args in (c))."""
    return [
        "--time-scale", str(args.time_scale),
        "--num-blocks", str(args.num_blocks),
        "--lora-load-time-s", str(args.lora_load_time_s),
        "--tokenizer", "tiny",
        # The reload and eviction lines are info lines: the only record of re-reads.
        "--log-level", "info",
    ]  # fmt: skip


@dataclass
class DirectRouter:
    urls: list[str]
    adapter_dir: Path
    policy: str  # engine_lru | rendezvous
    inflight: list[int] = field(default_factory=list)
    registered: list[set[str]] = field(default_factory=list)
    loading: dict[tuple[int, str], asyncio.Task[None]] = field(default_factory=dict)
    load_calls: int = 0
    load_refused: int = 0
    load_errors: list[str] = field(default_factory=list)
    turn: int = 0

    def __post_init__(self) -> None:
        self.inflight = [0] * len(self.urls)
        self.registered = [set() for _ in self.urls]
        self.ids = [f"replica-{i}" for i in range(len(self.urls))]

    def choose(self, name: str) -> int:
        if self.policy == "rendezvous":
            return rendezvous_top1(name, self.ids)
        low = min(self.inflight)
        tied = [i for i, n in enumerate(self.inflight) if n == low]
        self.turn += 1
        return tied[self.turn % len(tied)]

    async def _load(self, session: aiohttp.ClientSession, r: int, name: str) -> None:
        body = {"lora_name": name, "lora_path": str(self.adapter_dir / name)}
        deadline = time.monotonic() + 60
        while True:
            self.load_calls += 1
            async with session.post(f"{self.urls[r]}/v1/load_lora_adapter", json=body) as resp:
                text = await resp.text()
                if resp.status == 200 or (resp.status == 400 and "already been loaded" in text):
                    self.registered[r].add(name)
                    return
                if resp.status == 503 and time.monotonic() < deadline:
                    # Every held adapter is in use: retry, as a router would.
                    self.load_refused += 1
                    await asyncio.sleep(0.25)
                    continue
                self.load_errors.append(f"{resp.status} {text[:200]}")
                raise RuntimeError(f"load {name} on replica {r}: {resp.status} {text[:200]}")

    async def ensure(self, session: aiohttp.ClientSession, r: int, name: str) -> bool:
        """Load ``name`` on ``r`` unless registered; True when the request had to wait."""
        if name in self.registered[r]:
            return False
        task = self.loading.get((r, name))
        if task is None:
            task = asyncio.create_task(self._load(session, r, name))
            self.loading[(r, name)] = task
            key = (r, name)

            def forget(_t: asyncio.Task[None], key: tuple[int, str] = key) -> None:
                self.loading.pop(key, None)

            task.add_done_callback(forget)
        await asyncio.shield(task)
        return True

    async def send(
        self, session: aiohttp.ClientSession, req: Req, arrival: float, args: Any
    ) -> Outcome:
        name = adapter_name(req.adapter)
        r = self.choose(name)
        self.inflight[r] += 1
        try:
            try:
                held = await self.ensure(session, r, name)
            except Exception as exc:  # the load failed: the request is not sent
                return Outcome(req, error=repr(exc)[:300], replica=r, held=True)
            out = await _send(session, f"{self.urls[r]}/v1/chat/completions", req, args, arrival)
            out.held, out.replica = held, r
            return out
        finally:
            self.inflight[r] -= 1


def _start_engines(stack: Stack, args: argparse.Namespace) -> list[tuple[str, Path]]:
    env = base_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    engines: list[tuple[str, Path]] = []
    procs = []
    for i in range(args.replicas):
        port = free_port()
        argv = [
            sys.executable, "-m", "llmgw", "simengine",
            "--model", MODEL, "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port),
            "--block-size", "16", "--kv-extra-key-format", "tagged",
            # What llmgw's sim adapter adds for adapter_slots N: --max-loras min(N, 4).
            "--max-loras", str(min(args.slots, 4)), "--max-cpu-loras", str(args.slots),
            *_sim_flags(args),
        ]  # fmt: skip
        proc = stack.spawn(f"engine{i}", argv, env)
        procs.append(proc)
        engines.append((f"http://127.0.0.1:{port}", proc.log))
    for (url, _log), proc in zip(engines, procs, strict=True):

        def healthy(url: str = url) -> bool:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200

        wait_for(
            healthy,
            timeout_s=60,
            what=f"{url} healthy",
            check=proc.check,
        )
    return engines


def run_direct(
    policy: str, trace: list[Req], args: argparse.Namespace, adapter_dir: Path
) -> dict[str, Any]:
    stack = Stack(Path(tempfile.mkdtemp(prefix=f"llmgw-bench-adapters-{policy}-")))
    failed = True
    try:
        engines = _start_engines(stack, args)
        router = DirectRouter([u for u, _ in engines], adapter_dir, policy)

        async def send(session: aiohttp.ClientSession, req: Req, arrival: float) -> Outcome:
            return await router.send(session, req, arrival, args)

        t_run = time.monotonic()
        outcomes, wall0 = asyncio.run(_replay(trace, send))
        stack.check()
        logs = [_engine_log(path) for _, path in engines]
        m = _measure(outcomes, logs, wall0, args)
        m["run_s"] = round(time.monotonic() - t_run, 1)
        m["router"] = {
            "policy": "least-loaded, ties in turn"
            if policy == "engine_lru"
            else "rendezvous top-1",
            "load_calls": router.load_calls,
            "load_refused_503": router.load_refused,
            "load_errors": router.load_errors[:5],
            "registered_per_replica": [len(s) for s in router.registered],
        }
        m["requests_per_replica"] = [
            sum(1 for o in outcomes if o.replica == r) for r in range(args.replicas)
        ]
        failed = False
        return m
    finally:
        stack.close(failed=failed)


# --- arm (c): llmgw ------------------------------------------------------------------------


def _sql(db_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    from llmgw.embedded_postgres import libpq_url

    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        cur = conn.execute(query, params)
        return list(cur.fetchall()) if cur.description else []


def _ready_replicas(db_url: str) -> int:
    rows = _sql(
        db_url,
        "SELECT count(*) FROM shards s JOIN replicas r ON r.id = s.replica_id "
        "WHERE s.rank = 0 AND s.observed_state = 'ready' AND s.proxy_url <> '' "
        "AND NOT s.released AND r.state = 'active'",
    )
    return int(rows[0][0])


_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} ([0-9.e+-]+)$", re.M)


def _metric_sums(text: str, name: str, by: str | None) -> dict[str, float]:
    """Sum of a metric's samples, by one label's value ("" without a label)."""
    out: dict[str, float] = {}
    for n, labels, value in _SAMPLE.findall(text):
        if n != name:
            continue
        key = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get(by, "") if by else ""
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _documents(args: argparse.Namespace, adapter_dir: Path) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = [
        {"kind": "model", "name": MODEL},
        {
            "kind": "profile", "name": MODEL, "model": MODEL, "engine": "sim",
            "gpu_class": "sim", "model_path": MODEL, "adapter_slots": args.slots,
            "args": _sim_flags(args),
        },
        {"kind": "deployment", "name": MODEL, "model": MODEL, "profile": MODEL,
         "replicas": args.replicas},
    ]  # fmt: skip
    for i in range(args.adapters):
        name = adapter_name(i)
        docs.append(
            {"kind": "adapter", "name": name, "model": MODEL, "path": str(adapter_dir / name)}
        )
    return docs


def run_llmgw(trace: list[Req], args: argparse.Namespace, adapter_dir: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-adapters-llmgw-"))
    stack = Stack(tmp)
    failed = True
    shards: list[tuple[Any, ...]] = []
    try:
        stack.start_postgres()
        cp: ControlPlane = stack.controlplane("cp", short_periods=args.short_periods)
        cp.admin("POST", "/apply", {"documents": _documents(args, adapter_dir)})
        token = cp.admin("POST", "/bootstrap-tokens", {"pool": "default", "uses": 1})["token"]
        base = random.randrange(20000, 60000, 64)
        agent_env = base_env(
            LLMGW_AGENT__BOOTSTRAP_TOKEN=token,
            LLMGW_AGENT__PORT_RANGE_START=str(base),
            LLMGW_AGENT__PORT_RANGE_END=str(base + 63),
            LLMGW_AGENT__MGMT_ADDR="127.0.0.1",
            LLMGW_AGENT__PROXY_PORT="0",
            LLMGW_LOG__JSON="true",
            LLMGW_LOG__LEVEL="warning",
            **(
                {"LLMGW_AGENT__SYNC_INTERVAL_S": "0.5", "LLMGW_AGENT__HEALTH_INTERVAL_S": "0.5"}
                if args.short_periods
                else {}
            ),
        )
        agent_port = free_port()
        state_dir = tmp / "agent-state"
        stack.spawn(
            "agent",
            [sys.executable, "-m", "llmgw", "agent", "--controlplane-url", cp.url,
             "--state-dir", str(state_dir), "--node-name", "bench-node",
             "--listen-port", str(agent_port), "--sim-gpus", str(args.replicas)],
            agent_env,
        )  # fmt: skip
        wait_for(
            lambda: _ready_replicas(stack.db_url) >= args.replicas,
            timeout_s=180,
            what=f"{args.replicas} sim replicas ready",
            interval_s=0.5,
            check=stack.check,
        )
        key = cp.create_key()
        headers = {"Authorization": f"Bearer {key}"}
        url = cp.public_url + "/v1/chat/completions"
        hello = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        wait_for(
            lambda: httpx.post(url, json=hello, headers=headers, timeout=10).status_code == 200,
            timeout_s=60,
            what="the gateway to serve the base model",
            check=stack.check,
        )
        last_action = int(
            _sql(stack.db_url, "SELECT coalesce(max(id), 0) FROM reconcile_actions")[0][0]
        )

        async def send(session: aiohttp.ClientSession, req: Req, arrival: float) -> Outcome:
            return await _send(session, url, req, args, arrival, headers)

        async def replay_with_actions() -> tuple[list[Outcome], float, list[tuple[Any, ...]]]:
            # The leader trims its action record; read it as the run goes so none is missed.
            actions: list[tuple[Any, ...]] = []
            done = asyncio.Event()

            async def poll() -> None:
                nonlocal last_action
                while True:
                    rows = await asyncio.to_thread(
                        _sql, stack.db_url,
                        "SELECT id, extract(epoch from at), action, reason FROM reconcile_actions "
                        "WHERE id > %s AND action LIKE 'Adapter%%' ORDER BY id", last_action,
                    )  # fmt: skip
                    if rows:
                        last_action = int(rows[-1][0])
                        actions.extend(rows)
                    if done.is_set():
                        return
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), 2.0)

            poller = asyncio.create_task(poll())
            outcomes, wall0 = await _replay(trace, send)
            done.set()
            await poller
            return outcomes, wall0, actions

        t_run = time.monotonic()
        outcomes, wall0, actions = asyncio.run(replay_with_actions())
        stack.check()
        agent_metrics = httpx.get(f"http://127.0.0.1:{agent_port}/metrics", timeout=5).text
        gw_metrics = cp.metrics_text()
        logs = [_engine_log(p) for p in sorted(state_dir.rglob("simengine.log*"))]
        m = _measure(outcomes, logs, wall0, args)
        m["run_s"] = round(time.monotonic() - t_run, 1)
        held = _metric_sums(gw_metrics, "llmgw_gateway_adapter_held_answered_total", "outcome")
        m["held"] = int(sum(held.values()))
        m["held_by_outcome"] = {k: int(v) for k, v in sorted(held.items())}
        loads = _metric_sums(agent_metrics, "llmgw_agent_adapter_loads_total", "outcome")
        unloads = _metric_sums(agent_metrics, "llmgw_agent_adapter_unloads_total", None)
        m["agent"] = {
            "loads_ok": int(loads.get("ok", 0)),
            "loads_failed": int(loads.get("failed", 0)),
            "unloads": int(unloads.get("", 0)),
        }
        m["leader_actions"] = _action_summary(actions, wall0)
        failed = False
        return m
    finally:
        with contextlib.suppress(Exception):
            shards = _sql(stack.db_url, "SELECT id::text FROM shards") if stack.db_url else []
        stack.close(failed=failed)
        # Engines outlive their agent by design: stop every process marked with one of this
        # run's shard ids (the processes this bench's agent started, none other).
        from llmgw.nodeagent.procs import kill_marked

        for (shard,) in shards:
            kill_marked(shard)


def _action_summary(actions: list[tuple[Any, ...]], wall0: float) -> dict[str, Any]:
    """The leader's adapter actions by kind and by the start of their reason."""
    by_kind: dict[str, int] = {}
    loads_by_reason: dict[str, int] = {}
    unloads_by_reason: dict[str, int] = {}
    examples: dict[str, str] = {}
    for _id, _at, action, reason in actions:
        by_kind[action] = by_kind.get(action, 0) + 1
        m = re.search(r"\((.*)\)$", reason or "")
        why = m.group(1) if m else reason
        # "displacing lora-17" -> "displacing"; "displaced by lora-03, demand 1 req/s" -> ...
        short = re.sub(r"lora-\d+", "X", why)
        short = re.sub(r"[0-9][0-9.]*", "N", short)
        target = loads_by_reason if action == "AdapterLoad" else unloads_by_reason
        if action in ("AdapterLoad", "AdapterUnload"):
            target[short] = target.get(short, 0) + 1
            examples.setdefault(f"{action}: {short}", reason)
    return {
        "by_kind": by_kind,
        "loads_by_reason": dict(sorted(loads_by_reason.items(), key=lambda kv: -kv[1])[:8]),
        "unloads_by_reason": dict(sorted(unloads_by_reason.items(), key=lambda kv: -kv[1])[:8]),
        "example_per_reason": examples,
        "first": [
            {"t_s": round(float(a[1]) - wall0, 1), "action": a[2], "reason": a[3]}
            for a in actions[:6]
        ],
    }


# --- measuring ------------------------------------------------------------------------------


@dataclass
class EngineLog:
    loads: list[tuple[float, str]] = field(default_factory=list)  # (epoch s, adapter)
    rereads: list[tuple[float, str]] = field(default_factory=list)
    evicted: list[float] = field(default_factory=list)
    unloads: list[float] = field(default_factory=list)


def _epoch(ts: str | None) -> float:
    if not ts:
        return math.nan
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def _engine_log(path: Path) -> EngineLog:
    """The simulator's LoRA lines of one engine (JSON lines; other lines skipped)."""
    out = EngineLog()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if '"lora_adapter' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        ev, t = rec.get("event"), _epoch(rec.get("timestamp"))
        if ev == "lora_adapter_loading":
            out.loads.append((t, str(rec.get("adapter"))))
            out.evicted += [t] * len(rec.get("evicted") or ())
        elif ev == "lora_adapters_reloaded":
            out.rereads += [(t, str(a)) for a in rec.get("adapters") or ()]
            out.evicted += [t] * len(rec.get("evicted") or ())
        elif ev == "lora_adapter_unloaded":
            out.unloads.append(t)
    return out


def _measure(
    outcomes: list[Outcome], logs: list[EngineLog], wall0: float, args: argparse.Namespace
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    bad = [o for o in outcomes if not o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    minutes = args.duration_s / 60
    d = float(args.duration_s)

    def inside(t: float) -> bool:
        return 0 <= t - wall0 <= d

    loads = sum(1 for lg in logs for t, _ in lg.loads if inside(t))
    rereads = sum(1 for lg in logs for t, _ in lg.rereads if inside(t))
    evicted_logged = sum(1 for lg in logs for t in lg.evicted if inside(t))
    # Every read takes a slot; what an engine holds at the end is min(slots, distinct read):
    # the rest was evicted (logged or by trim). Counted over the whole run, then scaled to the
    # window's share of reads.
    evicted_derived = 0
    reads_all = 0
    for lg in logs:
        names = [a for _, a in (*lg.loads, *lg.rereads)]
        reads_all += len(names)
        evicted_derived += max(0, len(names) - min(args.slots, len(set(names))))
    reads = loads + rereads
    # Reads of an adapter into an engine that had read it before (a re-read after an
    # eviction, or a second load after an unload): the thrash part of the reads.
    repeat_reads = 0
    for lg in logs:
        seen: set[str] = set()
        for t, a in sorted((*lg.loads, *lg.rereads)):
            if a in seen and inside(t):
                repeat_reads += 1
            seen.add(a)
    evictions = round(evicted_derived * reads / reads_all) if reads_all else 0
    bins: dict[int, int] = {}
    for lg in logs:
        for t, _ in (*lg.loads, *lg.rereads):
            if inside(t):
                k = int((t - wall0) // 10)
                bins[k] = bins.get(k, 0) + 1
    all_ttfts = sorted(ttfts) + [math.inf] * len(bad)
    p90_inf = percentile(all_ttfts, 90) if all_ttfts else math.nan
    phase_p90 = {}
    for ph in (0, 1):
        xs = [o.ttft_s for o in ok if o.req.phase == ph and o.ttft_s is not None]
        phase_p90[f"phase{ph}"] = round(percentile(xs, 90) * 1e3, 1) if xs else None
    return {
        "requests": len(outcomes),
        "answered": len(ok),
        "errors": len(bad),
        "first_error": (f"{bad[0].status} {bad[0].error}"[:300]) if bad else "",
        "errors_by_status": _count(str(o.status) for o in bad),
        "ttft_ms": {
            "p50": round(percentile(ttfts, 50) * 1e3, 1) if ttfts else None,
            "p90": round(percentile(ttfts, 90) * 1e3, 1) if ttfts else None,
            "p99": round(percentile(ttfts, 99) * 1e3, 1) if ttfts else None,
            "mean": round(sum(ttfts) / len(ttfts) * 1e3, 1) if ttfts else None,
        },
        "ttft_ms_p90_by_phase": phase_p90,
        "ttft_ms_p90_failed_as_inf": (
            None
            if math.isnan(p90_inf)
            else (round(p90_inf * 1e3, 1) if math.isfinite(p90_inf) else "inf")
        ),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "held": sum(1 for o in outcomes if o.held),
        "loads": loads,
        "rereads": rereads,
        "reads": reads,
        "loads_per_min": round(reads / minutes, 2),
        "repeat_reads": repeat_reads,
        "repeat_reads_per_min": round(repeat_reads / minutes, 2),
        "evictions": evictions,
        "evictions_logged": evicted_logged,
        "evictions_per_min": round(evictions / minutes, 2),
        "unload_calls": sum(1 for lg in logs for t in lg.unloads if inside(t)),
        "unload_calls_per_min": round(
            sum(1 for lg in logs for t in lg.unloads if inside(t)) / minutes, 2
        ),
        "reads_per_10s": [bins.get(k, 0) for k in range(math.ceil(d / 10))],
        "_ttfts": [(o.req.at, o.ttft_s) for o in ok],
    }


def _count(xs: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


# --- report ----------------------------------------------------------------------------------


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return None
    return round(a / b, 3)


def _table(runs: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'arm':<12} {'TTFT p50':>9} {'TTFT p90':>9} {'loads/min':>10} {'repeat/min':>10} "
        f"{'evict/min':>10} "
        f"{'unload/min':>10} {'hit rate':>8} {'held':>6} {'errors':>6} {'answered':>8}"
    )
    lines = [head, "-" * len(head)]
    for arm, m in runs.items():
        lines.append(
            f"{arm:<12} {m['ttft_ms']['p50']!s:>9} {m['ttft_ms']['p90']!s:>9} "
            f"{m['loads_per_min']:>10} {m['repeat_reads_per_min']:>10} {m['evictions_per_min']:>10} "
            f"{m['unload_calls_per_min']:>10} {m['hit_rate']:>8} {m['held']:>6} "
            f"{m['errors']:>6} {m['answered']:>8}"
        )
    return "\n".join(lines)


def _chart(runs: dict[str, dict[str, Any]], args: argparse.Namespace, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 11))
    for arm, m in runs.items():
        xs = sorted(t for _, t in m["_ttfts"])
        if xs:
            ax1.plot([x * 1e3 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=arm)
        r = m["reads_per_10s"]
        if r:
            ax2.step([i * 10 for i in range(len(r) + 1)], [*r, r[-1]], where="post", label=arm)
        bins: dict[int, list[float]] = {}
        for at, t in m["_ttfts"]:
            bins.setdefault(int(at // 15), []).append(t)
        ks = sorted(bins)
        ax3.plot([k * 15 + 7.5 for k in ks], [percentile(bins[k], 90) * 1e3 for k in ks], label=arm)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (ms, wall, from scheduled arrival)")
    ax1.set_ylabel("share of answered requests")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    shift = args.duration_s * args.shift_at
    for ax in (ax2, ax3):
        ax.axvline(shift, color="grey", linestyle="--")
        ax.set_xlabel("seconds into the run (dashed: demand shifts)")
        ax.legend()
    ax2.set_ylabel("adapter reads per 10 s\n(loads + re-reads)")
    ax3.set_ylabel("TTFT p90 per 15 s (ms)")
    ax3.set_yscale("log")
    fig.suptitle(
        f"{args.replicas} sim replicas x {args.slots} slots, {args.adapters} adapters, "
        f"Zipf {args.zipf_s}, {args.rate} req/s, load {args.lora_load_time_s} s"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def _trace_stats(
    trace: list[Req], rankings: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    total_slots = args.replicas * args.slots
    beyond = sum(1 for r in trace if r.rank > total_slots)
    beyond_rep = sum(1 for r in trace if r.rank > args.slots)
    return {
        "requests": len(trace),
        "distinct_adapters": len({r.adapter for r in trace}),
        "top_adapter_share": round(sum(1 for r in trace if r.rank == 1) / max(1, len(trace)), 3),
        # Requests for an adapter ranked past every slot of the fleet (by its phase's ranking):
        # some adapter must be loaded for each, whatever the placement.
        f"share_ranked_past_{total_slots}_slots": round(beyond / max(1, len(trace)), 3),
        f"share_ranked_past_{args.slots}_slots": round(beyond_rep / max(1, len(trace)), 3),
        "top5_before_shift": [adapter_name(i) for i in rankings[0][:5]],
        "top5_after_shift": [adapter_name(i) for i in rankings[1][:5]],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    trace, rankings = make_trace(args)
    adapter_root = Path(tempfile.mkdtemp(prefix="llmgw-bench-adapter-dirs-"))
    for i in range(args.adapters):
        d = adapter_root / adapter_name(i)
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"r": 16, "lora_alpha": 32}))
    runs: dict[str, dict[str, Any]] = {}
    try:
        for arm in args.arms:
            print(
                f"[adapters] {arm}: {len(trace)} requests over {args.duration_s:g} s ...",
                file=sys.stderr,
            )
            if arm == "llmgw":
                runs[arm] = run_llmgw(trace, args, adapter_root)
            else:
                runs[arm] = run_direct(arm, trace, args, adapter_root)
            m = runs[arm]
            print(
                f"[adapters] {arm}: ttft p50 {m['ttft_ms']['p50']} p90 {m['ttft_ms']['p90']} ms, "
                f"{m['loads_per_min']} loads/min, {m['errors']} errors "
                f"({time.monotonic() - t_start:.0f} s)",
                file=sys.stderr,
            )
    finally:
        import shutil

        shutil.rmtree(adapter_root, ignore_errors=True)
    out: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "png")},
        "machine": {"cpus": os.cpu_count()},
        "trace": _trace_stats(trace, rankings, args),
        "runs": {
            arm: {k: v for k, v in m.items() if not k.startswith("_")} for arm, m in runs.items()
        },
    }
    base = runs.get("engine_lru")
    if base is not None:
        ratios: dict[str, Any] = {}
        for arm in ("rendezvous", "llmgw"):
            other = runs.get(arm)
            if other is None:
                continue
            m = other
            ratios[f"{arm}_vs_engine_lru"] = {
                "ttft_p50": _ratio(m["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
                "ttft_p90": _ratio(m["ttft_ms"]["p90"], base["ttft_ms"]["p90"]),
                "loads_per_min": _ratio(m["loads_per_min"], base["loads_per_min"]),
                "evictions_per_min": _ratio(m["evictions_per_min"], base["evictions_per_min"]),
                "hit_rate": _ratio(m["hit_rate"], base["hit_rate"]),
            }
        out["ratios"] = ratios
        lg = ratios.get("llmgw_vs_engine_lru")
        if lg is not None:
            out["acceptance"] = {
                f"llmgw_ttft_p90_le_{TARGET_TTFT_P90_RATIO}x_engine_lru": lg["ttft_p90"] is not None
                and lg["ttft_p90"] <= TARGET_TTFT_P90_RATIO,
                f"llmgw_loads_per_min_le_{TARGET_LOADS_RATIO}x_engine_lru": lg["loads_per_min"]
                is not None
                and lg["loads_per_min"] <= TARGET_LOADS_RATIO,
            }
    if args.png:
        out["chart"] = _chart(runs, args, Path(args.png))
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--slots", type=int, default=8, help="adapters an engine holds at once")
    ap.add_argument("--adapters", type=int, default=60)
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    ap.add_argument("--duration-s", type=float, default=150.0, help="arrival window per arm")
    ap.add_argument(
        "--shift-at", type=float, default=0.5, help="share of the window before the shift"
    )
    ap.add_argument("--prefix-words", type=int, default=160, help="per-adapter system prompt")
    ap.add_argument("--question-words", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--lora-load-time-s", type=float, default=0.5)
    ap.add_argument("--time-scale", type=float, default=3.0)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--short-periods", action="store_true",
                    help="(c) with 0.5 s reconcile tick and agent sync instead of the defaults")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "docs/bench/adapters.json"))
    ap.add_argument("--png", default=str(ROOT / "docs/bench/adapters.png"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    out = run(args)
    runs = out["runs"]
    print(_table(runs))
    for name, r in (out.get("ratios") or {}).items():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    for name, okay in (out.get("acceptance") or {}).items():
        print(f"{name}: {'met' if okay else 'NOT met'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}" + (f" and {out.get('chart')}" if args.png else ""))
    return out


if __name__ == "__main__":
    main()
