"""Benchmark: prefix-cache hit rate and TTFT per routing policy, against an offline oracle.

The real system on loopback: a throwaway Postgres, TWO `llmgw controlplane` processes on it
(two gateways sharing the replicas, clients split between them), one `llmgw agent
--sim-gpus N` running a deployment of N `sim` replicas with kv_events and a small KV cache
(`--num-blocks`), at a `--time-scale` this machine can carry. For each policy (random,
round_robin, least_loaded, approximate, precise) both control planes restart with
``LLMGW_GATEWAY__ROUTING_POLICY`` set to it (same ports: the agent and the clients keep their
URLs), then each workload's trace is replayed through them as streaming chat completions:

1. ``shared_prefix``, modelled on llm-d's benchmark: ``--groups`` groups of ``--users``
   users; every request is its group's long system prompt plus a short user-specific
   question, with a short answer; Poisson arrivals at ``--rate``. The system prompts'
   working set is sized (``--working-set``, default 1.75) against the replicas' total KV
   capacity (replicas x num_blocks x block_size), so no single replica, nor all of them
   holding each prompt everywhere, can keep it all.
2. ``multi_turn``: ``--conversations`` chats of ``--turns`` turns, each turn the whole
   history so far (a shared short system prompt, earlier questions and the engine's actual
   answers) plus a new question; conversations start as a Poisson process and wait
   ``--think-s`` (exponential) between an answer and the next turn.

Each policy run prepends a fresh random tag to every system prompt, so what the previous
run left in the caches matches nothing (the caches start full of cold blocks, which LRU
treats as empty) and no run inherits another's hits.

Per policy and workload: prefix-cache hit rate = sum(usage.prompt_tokens_details.
cached_tokens) / sum(usage.prompt_tokens), TTFT p50/p90 (first content chunk; also split
into requests the engine served mostly from cache and the rest, to show which queue), request
latency, requests/s and output tokens/s over the replay, and the gateways' own
``llmgw_prefix_decisions_total`` by method (to show a policy decided as it claims).

The ORACLE (computed offline per run from the prompts actually sent, tokenized as the
simulator does, in the order they were sent; one LRU cache of ``num_blocks`` blocks per
replica, a request hitting the longest run of its leading full blocks its replica holds,
never the last block of a prompt whose length is a multiple of the block size): the better
of two assignments, (a) greedy: each request to the replica holding most of its prefix
(ties: fewest requests so far), and (b) partitioned: each session (a group, a conversation)
pinned at its first request to the replica with the fewest sessions. Greedy alone is a poor
yardstick: once a prefix every request shares (a common system prompt) lives on one replica,
it sends everything there. A *heuristic*, not an upper bound: it ignores load and timing (a
request sent while another with its prefix is still in prefill may miss on an engine where
the oracle counts a hit), and a cleverer assignment could beat it. Reported beside it: a
*timed* variant (a block is usable only once the modelled prefill of the request computing it
is done, with no queueing) and a true upper bound (infinite capacity: a block misses only the
first time it is seen anywhere). All ignore blocks of generated tokens and the blocks running
requests pin.

A yardstick for TTFT (bench/engine_replay.py): each run's trace replayed offline through the
simulator's own scheduler and step cost model, one per replica, with every request placed where
its first token comes soonest given the engines' exact state (``clairvoyant``), and at random
(to check the model: its p90 should be near the measured random run's). Random's measured p90
over the clairvoyant replay's says how far any router could take the TTFT ratio on that trace
at that load; precise's over it, how far this router is from placing every request as well as
it can be placed on arrival. A third replay (``router``) places each request by llmgw's own
rule and the gateways' view of the load (one LoadTracker per gateway, fed by a scrape of the
engines' request counts), with KV shares read from the engines' exact caches: what the rule
loses against the clairvoyant, and what the running system loses against the replay (index
lag, tokenizing, the network).

Time: arrivals (``--rate``, ``--chat-rate``, ``--think-s``) are in modelled time, like the
engines' steps, so a ``--time-scale`` changes how long a run takes, not its load; TTFTs are
printed in wall-clock ms (divide by the time scale for modelled ms). On this 2-core machine
(four simulators, two control planes, an agent and the clients on two cores) the shared-prefix
workload at scale 1 measures precise's p90 1.5-2.0x its router replay, at scale 2 about 1.2x
(random's matches its replay at both). What precise does and random does not (tokenizing
through the agent, the index's lag behind the engines' events, more CPU on two busy cores)
takes wall time, half as large against the modelled time at scale 2: prefer
``--time-scale 2`` where the run time allows.

    .venv/bin/python bench/routing.py               # about 8-10 minutes on 2 cores
    .venv/bin/python bench/routing.py --policies random precise --requests 200
    .venv/bin/python bench/routing.py --repeats 3    # medians of 3 runs: one run's p90 varies ~15%
    # one JSON line per request, to find where the slow tenth comes from:
    .venv/bin/python bench/routing.py --policies precise --dump /tmp/requests.jsonl

Prints one JSON object. The router's targets: precise >= 90% of the oracle's hit rate;
precise TTFT p90 >= 5x better than random and >= 1.5x better than approximate.

Tokenizing. The simulators run ``--tokenizer tiny`` (``--sim-tokenizer``: the packaged tiny
model's tokenizer.json and chat template), so their agent ships those files and the gateways
tokenize prompts locally (policy ``precise``); ``precise_remote`` is the same policy with
``gateway.local_tokenize`` off, every prompt tokenized through a replica's ``/tokenize``.
Prompt sizes are given in that tokenizer's tokens (the words are scaled to it).

The load sweep (``--sweep [FACTOR ...]``, default 0.25 0.5 1 1.5 2): every policy at each
multiple of ``--rate`` and ``--chat-rate``, both workloads, the same trace per rate and repeat
for every policy; per rate the oracle's hit rate and the clairvoyant replay's TTFT p90 on the
precise run's trace, and the targets judged per rate: precise >= 0.9 of the oracle's hit rate,
precise TTFT p90 <= 1.25x the clairvoyant replay's, never worse than approximate or
least-loaded beyond the run-to-run spread (from ``--repeats``, else 15 %), and at the heaviest
rate precise sustains (no failed request) >= 5x better p90 than random. Tokenizing p50/p99:
per run from the gateways' histograms (bucket bounds) for local and remote, and the local path
timed in process on a ~4k-token chat (target: p99 under 2 ms). A PNG (``--sweep-png``) charts
TTFT p90 and hit rate against offered rate per policy.

    # docs/bench/routing-sweep.{json,png}: 4 replicas x 128 blocks, 2 gateways, working set
    # 1.75x capacity, --time-scale 1, one repeat; 634 s on the shared 2-core machine
    .venv/bin/python bench/routing.py --sweep --replicas 4 --num-blocks 128 --groups 8 \
        --users 4 --requests 30 --conversations 8 --turns 4 --turn-tokens 300 --think-s 0.5 \
        --sweep-png docs/bench/routing-sweep.png > docs/bench/routing-sweep.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    ControlPlane,
    Result,
    Stack,
    base_env,
    free_port,
    post,
    summarize,
    wait_for,
)

__all__ = ["main", "oracle_hit_rate"]

MODEL = "sim"
POLICIES = ("random", "round_robin", "least_loaded", "approximate", "precise", "precise_remote")
# A policy's gateway settings: "precise" tokenizes in the gateway from the model's tokenizer
# files the agent shipped (the default), "precise_remote" through a replica's /tokenize.
_POLICY_ENV = {"precise_remote": {"LLMGW_GATEWAY__ROUTING_POLICY": "precise",
                                  "LLMGW_GATEWAY__LOCAL_TOKENIZE": "false"}}  # fmt: skip
WORKLOADS = ("shared_prefix", "multi_turn")
TARGET_ORACLE_SHARE = 0.90
SIM_STEP_OVERHEAD_MS = 2.0  # `llmgw simengine --step-overhead-ms`, left at its default
TARGET_VS_RANDOM = 5.0
TARGET_VS_APPROXIMATE = 1.5

# Words the simulator's tokenizer keeps as one token each (lowercase, up to 3 letters, with a
# leading space): prompt lengths in tokens are then what the flags say.
_ALPHA = "abcdefghijklmnopqrstuvwxyz"


def _words(rng: random.Random, n: int) -> str:
    return "".join(
        " " + "".join(rng.choice(_ALPHA) for _ in range(rng.randint(2, 3))) for _ in range(n)
    )


def _text(rng: random.Random, tokens: int, args: argparse.Namespace) -> str:
    """About ``tokens`` tokens of words, in the simulator's tokenizer."""
    return _words(rng, max(1, round(tokens / args.tokens_per_word)))


# --- the trace ------------------------------------------------------------------------


@dataclass
class Sent:
    """One request as replayed: what was sent where, and what came back."""

    at: float  # seconds from the start of the replay
    gateway: int
    session: int  # the group (shared_prefix) or the conversation (multi_turn)
    messages: list[dict[str, str]]
    result: Result | None = None
    answer: str = ""


@dataclass
class Replay:
    sent: list[Sent] = field(default_factory=list)
    wall_s: float = 0.0


async def _stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    want_text: bool,
) -> tuple[Result, str]:
    """A streamed chat completion; with ``want_text`` the answer's text is collected too."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {key}"}
    if not want_text:
        return await post(session, url, body, headers), ""
    # The multi-turn workload needs the answer to build the next turn; parsed here rather
    # than in post() so the shared-prefix replay pays nothing for it.
    t0 = time.perf_counter()
    text: list[str] = []
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                err = (await resp.text())[:300]
                return Result(False, resp.status, time.perf_counter() - t0, error=err), ""
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return Result(False, 200, time.perf_counter() - t0, error=str(chunk)), ""
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(piece)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(False, 0, time.perf_counter() - t0, error=repr(exc)), ""
    return Result(True, 200, time.perf_counter() - t0, ttft, [], usage), "".join(text)


async def _replay_shared_prefix(
    urls: list[str], key: str, args: argparse.Namespace, tag: str, seed: int
) -> Replay:
    rng = random.Random(seed)
    # Group system prompts and user questions are the same across policies (same seed); the
    # tag alone differs, so each run starts from caches that hold nothing it can use.
    systems = [_text(rng, args.system_tokens, args) for _ in range(args.groups)]
    questions = [
        [_text(rng, args.question_tokens, args) for _ in range(args.users)]
        for _ in range(args.groups)
    ]
    plan: list[tuple[float, int, int]] = []
    t = 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        # Arrivals in modelled time: at --time-scale 2 they come half as fast, like everything
        # the engines do, so the load is the same at every scale.
        plan.append((t * args.time_scale, rng.randrange(args.groups), rng.randrange(args.users)))
    replay = Replay()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        t0 = time.perf_counter()

        async def one(at: float, g: int, u: int) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            gw = (g * args.users + u) % len(urls)  # a user always talks to one gateway
            messages = [
                {"role": "system", "content": f"run {tag} group {g}:{systems[g]}"},
                {"role": "user", "content": questions[g][u]},
            ]
            s = Sent(time.perf_counter() - t0, gw, g, messages)
            replay.sent.append(s)
            s.result, _ = await _stream_chat(
                session, urls[gw], key, messages, args.output_tokens, False
            )

        await asyncio.gather(*(one(*p) for p in plan))
        replay.wall_s = time.perf_counter() - t0
    return replay


async def _replay_multi_turn(
    urls: list[str], key: str, args: argparse.Namespace, tag: str, seed: int
) -> Replay:
    rng = random.Random(seed)
    system = _text(rng, args.chat_system_tokens, args)
    turns = [
        [_text(rng, args.turn_tokens, args) for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    starts: list[float] = []
    t = 0.0
    for _ in range(args.conversations):
        t += rng.expovariate(args.chat_rate)
        starts.append(t * args.time_scale)  # modelled time, as above
    thinks = [
        [rng.expovariate(1 / args.think_s) * args.time_scale for _ in range(args.turns)]
        for _ in turns
    ]
    replay = Replay()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        t0 = time.perf_counter()

        async def conversation(c: int) -> None:
            await asyncio.sleep(starts[c])
            gw = c % len(urls)
            history: list[dict[str, str]] = [{"role": "system", "content": f"run {tag}:{system}"}]
            for k in range(args.turns):
                history.append({"role": "user", "content": f"chat {c} turn {k}:{turns[c][k]}"})
                s = Sent(time.perf_counter() - t0, gw, c, list(history))
                replay.sent.append(s)
                s.result, s.answer = await _stream_chat(
                    session, urls[gw], key, s.messages, args.chat_output_tokens, True
                )
                if not s.result.ok:
                    return
                history.append({"role": "assistant", "content": s.answer})
                await asyncio.sleep(thinks[c][k])

        await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
        replay.wall_s = time.perf_counter() - t0
    return replay


# --- the oracle -----------------------------------------------------------------------


def _hf_tokenizer(name: str) -> Any:
    """The HfTokenizer of the simulator's --tokenizer (``tiny``: the packaged tiny model)."""
    from llmgw.kv.hf_tokenizer import HfTokenizer
    from llmgw.simengine.hf_tokens import read_tokenizer_dir, tiny_model_dir

    directory = tiny_model_dir() if name == "tiny" else Path(name)
    return HfTokenizer(read_tokenizer_dir(directory))


def _prompt_tokens(messages: list[dict[str, str]]) -> list[int]:
    """The prompt's ids as the simulator tokenizes it (its --tokenizer, or the builtin)."""
    name = _TOKENIZER.get("name", "builtin")
    if name != "builtin":
        hf = _TOKENIZER.get("hf")
        if hf is None:
            hf = _TOKENIZER["hf"] = _hf_tokenizer(name)
        return list(hf.chat_ids(messages))
    from llmgw.simengine.chat_template import render_chat
    from llmgw.simengine.tokenizer import Tokenizer

    tok = _TOKENIZER.setdefault("t", Tokenizer())
    return list(tok.tokenize(render_chat(messages), add_special_tokens=False))


_TOKENIZER: dict[str, Any] = {}


def _tokens_per_word(name: str) -> float:
    """How many tokens one of ``_words``' words costs the simulator's tokenizer: the builtin
    keeps each as one; a BPE splits them, so word counts are scaled to keep token sizes."""
    if name == "builtin":
        return 1.0
    hf = _hf_tokenizer(name)
    text = _words(random.Random(0), 2000)
    return len(hf.encode(text, add_special_tokens=False)) / 2000


def _block_chain(tokens: list[int], block_size: int) -> list[int]:
    """One id per full block, each depending on every token before it (as vLLM chains)."""
    out: list[int] = []
    h = 0
    for i in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(h)
    return out


def oracle_hit_rate(
    prompts: list[list[int]],
    *,
    replicas: int,
    capacity_blocks: int,
    block_size: int,
    sessions: list[int] | None = None,
    ready_at: list[tuple[float, float]] | None = None,
) -> dict[str, float]:
    """The oracle (the better of two assignments, each over per-replica LRU caches) and the
    infinite-cache upper bound; see the module docstring.

    ``prompts`` in the order they were sent; ``sessions`` (the group or conversation of each)
    enables the partitioned assignment. With ``ready_at`` = (sent, prefill done) per prompt, a
    block a request computes is usable only by requests sent after its prefill is done (a
    request sent while another is still in prefill recomputes the prefix).
    """
    greedy = _lru_assign(prompts, replicas, capacity_blocks, block_size, None, ready_at)
    out = {"greedy": greedy}
    if sessions is not None:
        out["partitioned"] = _lru_assign(
            prompts, replicas, capacity_blocks, block_size, sessions, ready_at
        )
    # Upper bound: infinite capacity, so a block misses only the first time it is seen.
    seen: dict[int, float] = {}
    total = bound = 0
    for i, tokens in enumerate(prompts):
        now, done = ready_at[i] if ready_at is not None else (float(i), float(i))
        chain = _block_chain(tokens, block_size)
        hittable = (len(tokens) - 1) // block_size  # at least one token is always computed
        first_new = next(
            (k for k, b in enumerate(chain) if seen.get(b, math.inf) > now), len(chain)
        )
        bound += min(first_new, hittable) * block_size
        total += len(tokens)
        for b in chain:
            seen[b] = min(seen.get(b, math.inf), done)
    return {
        "oracle": round(max(out.values()), 4),
        **{f"oracle_{k}": round(v, 4) for k, v in out.items()},
        "upper_bound_infinite_cache": round(bound / total, 4) if total else 0.0,
    }


def _lru_assign(
    prompts: list[list[int]],
    replicas: int,
    capacity_blocks: int,
    block_size: int,
    sessions: list[int] | None,
    ready_at: list[tuple[float, float]] | None,
) -> float:
    """Hit rate of one assignment over per-replica LRU caches of ``capacity_blocks``.

    sessions None: greedy, each request to the replica holding the longest run of its leading
    blocks (ties: fewest requests so far). Greedy alone piles everything onto the first
    replica once a prefix shared by all requests (a common system prompt) lives there, hence
    the second: each session pinned at its first request to the replica with the fewest
    sessions so far.
    """
    # Per replica: block -> the time it becomes usable; dict order = LRU order.
    caches: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(replicas)]
    assigned = [0] * replicas
    pinned: dict[int, int] = {}
    per_replica_sessions = [0] * replicas
    total = hit = 0
    for i, tokens in enumerate(prompts):
        now, done = ready_at[i] if ready_at is not None else (float(i), float(i))
        chain = _block_chain(tokens, block_size)
        matches = []
        for cache in caches:
            m = 0
            for b in chain:
                if cache.get(b, math.inf) > now:
                    break
                m += 1
            matches.append(m)
        if sessions is None:
            best = max(range(replicas), key=lambda r: (matches[r], -assigned[r], -r))
        else:
            sid = sessions[i]
            if sid not in pinned:
                pinned[sid] = min(range(replicas), key=lambda r: (per_replica_sessions[r], r))
                per_replica_sessions[pinned[sid]] += 1
            best = pinned[sid]
        hittable = (len(tokens) - 1) // block_size  # at least one token is always computed
        hit += min(matches[best], hittable) * block_size
        total += len(tokens)
        assigned[best] += 1
        cache = caches[best]
        for b in chain:
            cache[b] = min(cache.get(b, math.inf), done)
            cache.move_to_end(b)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / total if total else 0.0


# --- the system -----------------------------------------------------------------------


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


def _sim_args(args: argparse.Namespace) -> list[str]:
    return [
        "--num-blocks", str(args.num_blocks),
        "--time-scale", str(args.time_scale),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_batched_tokens),
        "--prefill-ms-per-token", str(args.prefill_ms_per_token),
        "--log-level", "warning",
        # The model's tokenizer files (the packaged tiny model's): the agent ships them and
        # the gateways tokenize locally with them, as with a vLLM model directory. Always
        # named: the sim adapter passes `tiny` to a profile that names none, so `builtin`
        # (the constructed vocabulary, no files) must be asked for.
        "--tokenizer", args.sim_tokenizer,
    ]  # fmt: skip


def _gateway_env(args: argparse.Namespace, policy: str) -> dict[str, str]:
    env = dict(kv.split("=", 1) for kv in args.gateway_env)
    env["LLMGW_GATEWAY__ROUTING_POLICY"] = policy
    env["LLMGW_GATEWAY__LOCAL_TOKENIZE"] = "true"
    env.update(_POLICY_ENV.get(policy, {}))
    return env


def _start_fleet(stack: Stack, args: argparse.Namespace, policy: str) -> list[ControlPlane]:
    stack.start_postgres()
    env = _gateway_env(args, policy)
    cps = [stack.controlplane(f"cp{i + 1}", **env) for i in range(args.gateways)]
    cp = cps[0]
    cp.sim_deployment(
        MODEL,
        replicas=args.replicas,
        kv_events=True,
        kv_block_size=args.block_size,
        args=_sim_args(args),
    )
    token = cp.admin("POST", "/bootstrap-tokens", {"pool": "default", "uses": 1})["token"]
    base = random.randrange(20000, 60000, 64)
    agent_env = base_env(
        LLMGW_AGENT__BOOTSTRAP_TOKEN=token,
        LLMGW_AGENT__PORT_RANGE_START=str(base),
        LLMGW_AGENT__PORT_RANGE_END=str(base + 63),
        LLMGW_AGENT__MGMT_ADDR="127.0.0.1",
        LLMGW_AGENT__PROXY_PORT="0",
        LLMGW_AGENT__SYNC_INTERVAL_S="0.5",
        LLMGW_AGENT__HEALTH_INTERVAL_S="0.5",
        LLMGW_LOG__JSON="true",
        LLMGW_LOG__LEVEL="warning",
    )
    agent_port = free_port()
    # Where the sweep samples how far the gateways' KV index trails the engines.
    args.agent_metrics_url = f"http://127.0.0.1:{agent_port}/metrics"
    stack.spawn(
        "agent",
        [sys.executable, "-m", "llmgw", "agent", "--controlplane-url", cp.url,
         "--state-dir", str(stack.tmp / "agent-state"), "--node-name", "bench-node",
         "--listen-port", str(agent_port), "--sim-gpus", str(args.replicas)],
        agent_env,
    )  # fmt: skip
    wait_for(
        lambda: _ready_replicas(stack.db_url) >= args.replicas,
        timeout_s=120,
        what=f"{args.replicas} sim replicas ready",
        interval_s=0.5,
        check=stack.check,
    )
    return cps


def _wait_serving(cps: list[ControlPlane], key: str, stack: Stack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for cp in cps:
        url = cp.public_url + "/v1/chat/completions"

        def serves(url: str = url) -> bool:
            r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)
            return r.status_code == 200

        wait_for(serves, timeout_s=60, what=f"{cp.name} to serve", check=stack.check)


# Gateway counters worth seeing beside each run, summed over the gateways, by the label that
# says what happened.
_COUNTERS = {
    "llmgw_prefix_decisions_total": ("method", "outcome"),
    "llmgw_prefix_tokenize_failures_total": ("reason",),
    "llmgw_gateway_retries_total": ("reason",),
    "llmgw_gateway_upstream_errors_total": ("kind",),
}
_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} ([0-9.e+-]+)$", re.M)


def _counters(cps: list[ControlPlane]) -> dict[str, float]:
    out: dict[str, float] = {}
    for cp in cps:
        try:
            text = cp.metrics_text()
        except httpx.HTTPError:
            continue
        for name, labels, value in _SAMPLE.findall(text):
            keys = _COUNTERS.get(name)
            if keys is None:
                continue
            parts = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            k = (
                name.removeprefix("llmgw_").removesuffix("_total")
                + ":"
                + "/".join(parts.get(x, "?") for x in keys)
            )
            out[k] = out.get(k, 0.0) + float(value)
    return out


def _measure(replay: Replay, args: argparse.Namespace) -> dict[str, Any]:
    ok = [s for s in replay.sent if s.result is not None and s.result.ok and s.result.usage]
    failed = [s for s in replay.sent if s.result is None or not s.result.ok]
    prompt = sum(int(s.result.usage["prompt_tokens"]) for s in ok if s.result and s.result.usage)
    cached = 0
    completion = 0
    for s in ok:
        assert s.result is not None and s.result.usage is not None
        details = s.result.usage.get("prompt_tokens_details") or {}
        cached += int(details.get("cached_tokens") or 0)
        completion += int(s.result.usage.get("completion_tokens") or 0)
    ttfts = [s.result.ttft_s for s in ok if s.result and s.result.ttft_s is not None]
    # Split by what the engine had cached (at least half the prompt: a hit): where the slow
    # tenth comes from, misses queueing or hits queueing behind them.
    by_hit: dict[bool, list[float]] = {True: [], False: []}
    for s in ok:
        assert s.result is not None and s.result.usage is not None
        if s.result.ttft_s is None:
            continue
        details = s.result.usage.get("prompt_tokens_details") or {}
        hit = 2 * int(details.get("cached_tokens") or 0) >= int(s.result.usage["prompt_tokens"])
        by_hit[hit].append(s.result.ttft_s)
    return {
        "requests": len(replay.sent),
        "failed": len(failed),
        "first_failure": failed[0].result.error if failed and failed[0].result else "",
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_ms": summarize(ttfts, digits=1),
        "ttft_ms_hits": summarize(by_hit[True], digits=1),
        "ttft_ms_misses": summarize(by_hit[False], digits=1),
        "latency_ms": summarize([s.result.latency_s for s in ok if s.result], digits=1),
        "wall_s": round(replay.wall_s, 2),
        "requests_per_s": round(len(ok) / replay.wall_s, 2) if replay.wall_s else 0.0,
        "output_tokens_per_s": round(completion / replay.wall_s, 1) if replay.wall_s else 0.0,
    }


def _prefill_s(tokens: int, args: argparse.Namespace) -> float:
    """The simulator's modelled time to prefill ``tokens`` uncached tokens in one step."""
    ms = SIM_STEP_OVERHEAD_MS + tokens * float(args.prefill_ms_per_token)
    return ms * float(args.time_scale) / 1e3


def _replayed(
    sent: list[Sent],
    prompts: list[list[int]],
    args: argparse.Namespace,
    assigns: tuple[Literal["clairvoyant", "router", "random"], ...] = (
        "clairvoyant",
        "router",
        "random",
    ),
) -> dict[str, Any]:
    """The run's trace through the simulator's own scheduler offline (engine_replay.py): each
    request at its soonest first token with the engines' exact state (clairvoyant), by the
    gateways' own rule and load view with exact KV shares (router), and at random (to check
    the model against the measured random run)."""
    from engine_replay import Arrival, replay

    from llmgw.config import GatewaySettings
    from llmgw.simengine.scheduler import SchedulerConfig
    from llmgw.simengine.timing import TimingModel

    arrivals = []
    for s, p in zip(sent, prompts, strict=True):
        usage = (s.result.usage if s.result is not None else None) or {}
        tokens = int(usage.get("completion_tokens") or 1)
        arrivals.append(Arrival(s.at, tuple(p), tokens, gateway=s.gateway))
    config = SchedulerConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    timing = TimingModel(
        step_overhead_ms=SIM_STEP_OVERHEAD_MS,
        prefill_ms_per_token=args.prefill_ms_per_token,
        time_scale=args.time_scale,
    )
    # The gateways' settings as the bench gave them (--gateway-env), for the router replay.
    prefix = "LLMGW_GATEWAY__"
    settings = GatewaySettings(
        **{k[len(prefix) :].lower(): v for k, v in _gateway_env(args, "precise").items()}
    )
    out: dict[str, Any] = {}
    for assign in assigns:
        r = replay(
            arrivals,
            replicas=args.replicas,
            config=config,
            timing=timing,
            assign=assign,
            settings=settings,
        )
        ttft = summarize(r.ttft_s, digits=1, scale=1e3)
        out[f"{assign}_replayed_ttft_p90_ms"] = ttft.get("p90")
        out[f"{assign}_replayed_hit_rate"] = round(r.hit_rate, 4)
    return out


def _oracle(
    replay: Replay,
    args: argparse.Namespace,
    assigns: tuple[Literal["clairvoyant", "router", "random"], ...] = (
        "clairvoyant",
        "router",
        "random",
    ),
) -> dict[str, Any]:
    """The oracle on this run's prompts: untimed, and timed by this run's prefill times."""
    sent = sorted(replay.sent, key=lambda s: s.at)
    prompts = [_prompt_tokens(s.messages) for s in sent]
    sizes = {
        "replicas": args.replicas,
        "capacity_blocks": args.num_blocks,
        "block_size": args.block_size,
    }
    sessions = [s.session for s in sent]
    untimed = oracle_hit_rate(prompts, sessions=sessions, **sizes)
    # Usable once computed: sent + the modelled prefill of the whole prompt, with no queueing
    # (the best any router could do; this run's own queueing would judge the policy by itself).
    ready = [(s.at, s.at + _prefill_s(len(p), args)) for s, p in zip(sent, prompts, strict=True)]
    timed = oracle_hit_rate(prompts, sessions=sessions, ready_at=ready, **sizes)
    # Our tokenization must be the engine's, or the oracle judges other prompts.
    mismatched = sum(
        1
        for s, p in zip(sent, prompts, strict=True)
        if s.result is not None
        and s.result.usage is not None
        and int(s.result.usage["prompt_tokens"]) != len(p)
    )
    replayed = _replayed(sent, prompts, args, assigns)
    return {
        **replayed,
        "untimed": untimed["oracle"],
        "untimed_greedy": untimed["oracle_greedy"],
        "untimed_partitioned": untimed["oracle_partitioned"],
        "timed": timed["oracle"],
        "upper_bound_infinite_cache": untimed["upper_bound_infinite_cache"],
        "upper_bound_timed": timed["upper_bound_infinite_cache"],
        "prompt_token_mismatches": mismatched,
        "working_set_tokens": len({b for p in prompts for b in _block_chain(p, args.block_size)})
        * args.block_size,
    }


def _system_tokens(args: argparse.Namespace, capacity_tokens: int) -> int:
    """The words of each group's system prompt, in tokens, so that the prompts as sent (the
    run's tag and the chat template around them included) make --working-set x capacity."""
    wrapper = _prompt_tokens([{"role": "system", "content": f"run {'0' * 8} group {args.groups}:"}])
    return max(1, int(args.working_set * capacity_tokens / args.groups) - len(wrapper))


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-"))
    stack = Stack(tmp)
    capacity_tokens = args.replicas * args.num_blocks * args.block_size
    if args.system_tokens <= 0:
        # Size the shared prompts so their working set is --working-set x the fleet's capacity.
        args.system_tokens = _system_tokens(args, capacity_tokens)
    results: dict[str, dict[str, Any]] = {w: {} for w in args.workloads}
    t_start = time.monotonic()
    try:
        cps = _start_fleet(stack, args, args.policies[0])
        key = cps[0].create_key()
        urls = [cp.public_url + "/v1/chat/completions" for cp in cps]
        # Repeats cycle through every policy in turn (a machine whose speed drifts slows all
        # policies alike); each repeat replays new traces, the same for every policy in it.
        cycle = [(r, p) for r in range(args.repeats) for p in args.policies]
        for i, (repeat, policy) in enumerate(cycle):
            if i > 0:
                for cp in cps:
                    cp.restart(**_gateway_env(args, policy))
            _wait_serving(cps, key, stack)
            for w, workload in enumerate(args.workloads):
                tag = uuid.uuid4().hex[:8]
                seed = args.seed + w + 1000 * repeat
                before = _counters(cps)
                replay_fn = (
                    _replay_shared_prefix if workload == "shared_prefix" else _replay_multi_turn
                )
                replay = asyncio.run(replay_fn(urls, key, args, tag, seed))
                stack.check()
                m = _measure(replay, args)
                after = _counters(cps)
                m["gateway_counters"] = {
                    k: after[k] - before.get(k, 0.0)
                    for k in sorted(after)
                    if after[k] - before.get(k, 0.0)
                }
                m["oracle"] = _oracle(replay, args)
                _add_run(results[workload], policy, m)
                if args.dump:
                    _dump(args.dump, workload, policy, repeat, replay)
                print(
                    f"[routing] {workload} {policy} #{repeat + 1}: hit {m['hit_rate']} ttft p90 "
                    f"{m['ttft_ms'].get('p90')} ms, oracle {m['oracle']['untimed']}, "
                    f"replayed p90: clairvoyant {m['oracle']['clairvoyant_replayed_ttft_p90_ms']}"
                    f" ms, router {m['oracle']['router_replayed_ttft_p90_ms']} ms; "
                    f"{m['failed']} failed "
                    f"({time.monotonic() - t_start:.0f}s)",
                    file=sys.stderr,
                )
    finally:
        shards: list[tuple[Any, ...]] = []
        with contextlib.suppress(Exception):
            shards = _sql(stack.db_url, "SELECT id::text FROM shards") if stack.db_url else []
        stack.close(failed=sys.exc_info()[0] is not None)
        # Engines outlive their agent by design (an agent restart must not take them down):
        # stop every process marked with one of this run's shard ids.
        from llmgw.nodeagent.procs import kill_marked

        for (shard,) in shards:
            kill_marked(shard)
    return _report(args, results, capacity_tokens, time.monotonic() - t_start)


def _dump(path: Path, workload: str, policy: str, repeat: int, replay: Replay) -> None:
    """One JSON line per request (for finding where a policy's slow tenth comes from)."""
    with path.open("a") as f:
        for s in sorted(replay.sent, key=lambda s: s.at):
            r = s.result
            usage = (r.usage if r is not None else None) or {}
            details = usage.get("prompt_tokens_details") or {}
            row = {
                "workload": workload,
                "policy": policy,
                "repeat": repeat,
                "at_s": round(s.at, 4),
                "gateway": s.gateway,
                "session": s.session,
                "messages": len(s.messages),
                "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": details.get("cached_tokens"),
                "ttft_ms": round(r.ttft_s * 1e3, 1) if r is not None and r.ttft_s else None,
                "ok": r is not None and r.ok,
            }
            f.write(json.dumps(row) + "\n")


def _add_run(per_policy: dict[str, Any], policy: str, m: dict[str, Any]) -> None:
    """Keep the latest run's whole measurement, every run's headline figures, and their
    medians (what the targets are judged on when there is more than one run)."""
    runs = per_policy.get(policy, {}).get("runs", [])
    runs.append(
        {
            "hit_rate": m["hit_rate"],
            "ttft_p90_ms": m["ttft_ms"].get("p90"),
            "oracle_untimed": m["oracle"]["untimed"],
            "oracle_timed": m["oracle"]["timed"],
            "clairvoyant_ttft_p90_ms": m["oracle"]["clairvoyant_replayed_ttft_p90_ms"],
            "router_replay_ttft_p90_ms": m["oracle"]["router_replayed_ttft_p90_ms"],
        }
    )
    m["runs"] = runs
    m["median"] = {
        k: statistics.median(r[k] for r in runs if r[k] is not None)
        for k in (
            "hit_rate",
            "ttft_p90_ms",
            "oracle_untimed",
            "oracle_timed",
            "clairvoyant_ttft_p90_ms",
            "router_replay_ttft_p90_ms",
        )
    }
    per_policy[policy] = m


def _ratio(a: float | None, b: float | None) -> float | None:
    if not a or not b:
        return None
    return round(a / b, 2)


def _report(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    capacity_tokens: int,
    wall_s: float,
) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for workload, per in results.items():
        p = per.get("precise")
        if p is None:
            continue
        # Judged against the (untimed) oracle on the precise runs' own traces, on the medians
        # of the runs.
        oracle = p["median"]["oracle_untimed"]
        t: dict[str, Any] = {
            "runs": len(p["runs"]),
            "precise_share_of_oracle": round(p["median"]["hit_rate"] / oracle, 3)
            if oracle
            else None,
            "precise_share_of_timed_oracle": round(
                p["median"]["hit_rate"] / p["median"]["oracle_timed"], 3
            )
            if p["median"]["oracle_timed"]
            else None,
        }
        p90 = p["median"]["ttft_p90_ms"]
        for other, goal in (("random", TARGET_VS_RANDOM), ("approximate", TARGET_VS_APPROXIMATE)):
            if other in per:
                r = _ratio(per[other]["median"]["ttft_p90_ms"], p90)
                t[f"ttft_p90_{other}_over_precise"] = r
                t[f"meets_{other}"] = r is not None and r >= goal
        # How far a router could take the ratio on these traces: random's measured p90 over
        # the clairvoyant replay's (each request at its soonest first token, engines' exact
        # state known). Far below the target, the target is a question of load.
        if "random" in per:
            t["ttft_p90_random_over_clairvoyant"] = _ratio(
                per["random"]["median"]["ttft_p90_ms"], p["median"]["clairvoyant_ttft_p90_ms"]
            )
        t["ttft_p90_precise_over_clairvoyant"] = _ratio(p90, p["median"]["clairvoyant_ttft_p90_ms"])
        # The rule and the gateways' load view, replayed with exact KV shares and no network:
        # measured precise over it is what the running system loses outside the rule.
        t["ttft_p90_precise_over_router_replay"] = _ratio(
            p90, p["median"]["router_replay_ttft_p90_ms"]
        )
        share = t["precise_share_of_oracle"]
        t["meets_oracle"] = share is not None and share >= TARGET_ORACLE_SHARE
        targets[workload] = t
    return {
        "bench": "routing",
        "gateways": args.gateways,
        "replicas": args.replicas,
        "num_blocks": args.num_blocks,
        "block_size": args.block_size,
        "kv_capacity_tokens_total": capacity_tokens,
        "time_scale": args.time_scale,
        "prefill_ms_per_token": args.prefill_ms_per_token,
        "shared_prefix": {
            "groups": args.groups,
            "users": args.users,
            "system_tokens": args.system_tokens,
            "question_tokens": args.question_tokens,
            "output_tokens": args.output_tokens,
            "rate_per_s": args.rate,
            "requests": args.requests,
            "working_set_over_capacity": round(
                args.groups * args.system_tokens / capacity_tokens, 2
            ),
        },
        "multi_turn": {
            "conversations": args.conversations,
            "turns": args.turns,
            "turn_tokens": args.turn_tokens,
            "output_tokens": args.chat_output_tokens,
        },
        "results": results,
        "targets": targets,
        "target_levels": {
            "precise_share_of_oracle": TARGET_ORACLE_SHARE,
            "ttft_p90_random_over_precise": TARGET_VS_RANDOM,
            "ttft_p90_approximate_over_precise": TARGET_VS_APPROXIMATE,
        },
        "wall_s": round(wall_s, 1),
    }


# --- the load sweep ---------------------------------------------------------------------

# Run-to-run spread of one run's TTFT p90 on this machine when --repeats gives no measure
# of it (the module docstring's ~15 %).
_DEFAULT_SPREAD = 0.15
TARGET_OVER_CLAIRVOYANT = 1.25
_TOKENIZE_HISTOGRAMS = {
    "local": "llmgw_prefix_tokenize_local_seconds",
    "remote": "llmgw_prefix_tokenize_seconds",
}
_BUCKET = re.compile(r'^(\w+)_bucket\{([^}]*)le="([^"]+)"[^}]*\} ([0-9.e+-]+)$', re.M)


def _buckets(cps: list[ControlPlane]) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts of the tokenizing histograms, summed over the gateways."""
    out: dict[str, dict[float, float]] = {k: {} for k in _TOKENIZE_HISTOGRAMS}
    names = {v: k for k, v in _TOKENIZE_HISTOGRAMS.items()}
    for cp in cps:
        for m in _BUCKET.finditer(cp.metrics_text()):
            kind = names.get(m.group(1))
            if kind is None:
                continue
            le = math.inf if m.group(3) == "+Inf" else float(m.group(3))
            out[kind][le] = out[kind].get(le, 0.0) + float(m.group(4))
    return out


def _quantiles(
    before: dict[float, float], after: dict[float, float]
) -> dict[str, float | int | None]:
    """p50/p99 (the bucket's upper bound, in ms) and the count of one run's observations."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0.0
    out: dict[str, float | int | None] = {"count": int(total)}
    for name, q in (("p50_ms_at_most", 0.5), ("p99_ms_at_most", 0.99)):
        le = next((le for le, n in delta if total and n >= q * total), None)
        out[name] = None if le is None or le == math.inf else round(le * 1e3, 3)
    return out


class _LagSampler:
    """The agent's ``llmgw_agent_kv_relay_lag_seconds`` (the oldest change a control plane has
    not acknowledged), sampled every 0.2 s on a thread while a replay runs: the index's lag."""

    _LAG = re.compile(r"^llmgw_agent_kv_relay_lag_seconds\{[^}]*\} ([0-9.e+-]+)$", re.M)

    def __init__(self, url: str | None) -> None:
        import threading

        self._url = url
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _LagSampler:
        if self._url:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        assert self._url is not None
        with httpx.Client(timeout=1) as client:
            while not self._stop.wait(0.2):
                with contextlib.suppress(httpx.HTTPError):
                    text = client.get(self._url).text
                    lags = [float(v) for v in self._LAG.findall(text)]
                    if lags:
                        self.samples.append(max(lags))

    def summary(self) -> dict[str, float | None]:
        if not self.samples:
            return {"max_s": None, "mean_s": None}
        return {
            "max_s": round(max(self.samples), 3),
            "mean_s": round(statistics.mean(self.samples), 3),
        }


def _local_tokenize_bench(args: argparse.Namespace) -> dict[str, Any]:
    """In process, the gateway's local tokenizing of a ~4k-token chat (what the target is
    set on): the same HfTokenizer and request path, each request a new question after the
    same system prompt (its piece cached after the first), and the whole text uncached."""
    if args.sim_tokenizer == "builtin":
        return {}
    hf = _hf_tokenizer(args.sim_tokenizer)
    rng = random.Random(7)
    system = _text(rng, 3900, args)
    bodies = [
        {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": _text(rng, 60, args)},
            ]
        }
        for _ in range(300)
    ]
    hf.request_ids(bodies[0], chat=True)
    times = []
    for body in bodies:
        t0 = time.perf_counter()
        ids = hf.request_ids(body, chat=True)
        times.append(time.perf_counter() - t0)
    text = hf.render_chat(bodies[-1]["messages"])
    whole = []
    for _ in range(30):
        t0 = time.perf_counter()
        hf._tok.encode(text, add_special_tokens=False)
        whole.append(time.perf_counter() - t0)
    ms = summarize(times, digits=3, scale=1e3)
    return {
        "chat_tokens": len(ids or ()),
        "p50_ms": ms.get("p50"),
        "p99_ms": ms.get("p99"),
        "uncached_p50_ms": summarize(whole, digits=3, scale=1e3).get("p50"),
        "target_p99_ms": 2.0,
        "meets": (ms.get("p99") or math.inf) < 2.0,
    }


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Every policy at ``--sweep`` multiples of ``--rate`` / ``--chat-rate``, both workloads;
    the oracle and the clairvoyant replay on each rate's precise trace."""
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-sweep-"))
    stack = Stack(tmp)
    capacity_tokens = args.replicas * args.num_blocks * args.block_size
    if args.system_tokens <= 0:
        args.system_tokens = _system_tokens(args, capacity_tokens)
    factors = list(args.sweep)
    # per[workload][factor index][policy] -> list of runs
    per: dict[str, list[dict[str, list[dict[str, Any]]]]] = {
        w: [{} for _ in factors] for w in args.workloads
    }
    t_start = time.monotonic()
    try:
        cps = _start_fleet(stack, args, args.policies[0])
        key = cps[0].create_key()
        urls = [cp.public_url + "/v1/chat/completions" for cp in cps]
        for i, policy in enumerate(args.policies):
            if i > 0:
                for cp in cps:
                    cp.restart(**_gateway_env(args, policy))
            _wait_serving(cps, key, stack)
            for repeat in range(args.repeats):
                for f, factor in enumerate(factors):
                    for w, workload in enumerate(args.workloads):
                        ns = argparse.Namespace(**vars(args))
                        ns.rate = args.rate * factor
                        ns.chat_rate = args.chat_rate * factor
                        # The same trace for every policy at this rate and repeat.
                        seed = args.seed + w + 100 * f + 1000 * repeat
                        tag = uuid.uuid4().hex[:8]
                        before, hist0 = _counters(cps), _buckets(cps)
                        replay_fn = (
                            _replay_shared_prefix
                            if workload == "shared_prefix"
                            else _replay_multi_turn
                        )
                        with _LagSampler(getattr(args, "agent_metrics_url", None)) as lag:
                            replay = asyncio.run(replay_fn(urls, key, ns, tag, seed))
                        stack.check()
                        m = _measure(replay, ns)
                        after, hist1 = _counters(cps), _buckets(cps)
                        run = {
                            "index_lag": lag.summary(),
                            "hit_rate": m["hit_rate"],
                            "ttft_p50_ms": m["ttft_ms"].get("p50"),
                            "ttft_p90_ms": m["ttft_ms"].get("p90"),
                            "failed": m["failed"],
                            "requests": m["requests"],
                            "requests_per_s": m["requests_per_s"],
                            "wall_s": m["wall_s"],
                            "tokenize": {
                                k: _quantiles(hist0[k], hist1[k]) for k in _TOKENIZE_HISTOGRAMS
                            },
                            "tokenize_failures": _delta(before, after, "prefix_tokenize_failures:"),
                            "decisions": _delta(before, after, "prefix_decisions:"),
                        }
                        if policy == "precise":
                            o = _oracle(replay, ns, ("clairvoyant",))
                            run["oracle_hit_rate"] = o["untimed"]
                            run["oracle_timed_hit_rate"] = o["timed"]
                            run["clairvoyant_ttft_p90_ms"] = o["clairvoyant_replayed_ttft_p90_ms"]
                            run["clairvoyant_hit_rate"] = o["clairvoyant_replayed_hit_rate"]
                            run["prompt_token_mismatches"] = o["prompt_token_mismatches"]
                        per[workload][f].setdefault(policy, []).append(run)
                        print(
                            f"[sweep] {workload} x{factor} {policy} #{repeat + 1}: hit "
                            f"{run['hit_rate']} p90 {run['ttft_p90_ms']} ms"
                            + (
                                f", oracle {run['oracle_hit_rate']}, clairvoyant p90 "
                                f"{run['clairvoyant_ttft_p90_ms']} ms"
                                if policy == "precise"
                                else ""
                            )
                            + f"; {run['failed']} failed ({time.monotonic() - t_start:.0f}s)",
                            file=sys.stderr,
                        )
    finally:
        shards: list[tuple[Any, ...]] = []
        with contextlib.suppress(Exception):
            shards = _sql(stack.db_url, "SELECT id::text FROM shards") if stack.db_url else []
        stack.close(failed=sys.exc_info()[0] is not None)
        from llmgw.nodeagent.procs import kill_marked

        for (shard,) in shards:
            kill_marked(shard)
    report = _sweep_report(args, per, factors, capacity_tokens, time.monotonic() - t_start)
    if args.sweep_png is not None:
        _sweep_chart(report, args.sweep_png)
        report["chart"] = str(args.sweep_png)
    return report


def _delta(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    return {
        k.removeprefix(prefix): after[k] - before.get(k, 0.0)
        for k in sorted(after)
        if k.startswith(prefix) and after[k] - before.get(k, 0.0)
    }


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _sweep_report(
    args: argparse.Namespace,
    per: dict[str, list[dict[str, list[dict[str, Any]]]]],
    factors: list[float],
    capacity_tokens: int,
    wall_s: float,
) -> dict[str, Any]:
    workloads: dict[str, Any] = {}
    for workload, by_rate in per.items():
        rows = []
        for f, policies in enumerate(by_rate):
            offered = (args.rate if workload == "shared_prefix" else args.chat_rate) * factors[f]
            row: dict[str, Any] = {"factor": factors[f], "offered_rate_per_s": round(offered, 3)}
            med: dict[str, dict[str, Any]] = {}
            for policy, runs in policies.items():
                med[policy] = {
                    k: _median(runs, k)
                    for k in ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "requests_per_s")
                }
                med[policy]["failed"] = sum(r["failed"] for r in runs)
                med[policy]["runs"] = runs
            p = policies.get("precise", [])
            oracle = _median(p, "oracle_hit_rate")
            clair = _median(p, "clairvoyant_ttft_p90_ms")
            row["policies"] = med
            row["oracle_hit_rate"] = oracle
            row["clairvoyant_ttft_p90_ms"] = clair
            row["clairvoyant_hit_rate"] = _median(p, "clairvoyant_hit_rate")
            precise = med.get("precise", {})
            p90s = [r["ttft_p90_ms"] for r in p if r["ttft_p90_ms"]]
            spread = (
                (max(p90s) - min(p90s)) / statistics.median(p90s)
                if len(p90s) > 1
                else _DEFAULT_SPREAD
            )
            row["spread"] = round(spread, 3)
            row["spread_from"] = "repeats" if len(p90s) > 1 else "default (1 repeat)"
            # Sustained: precise served every request (no failures).
            row["sustained"] = bool(p) and precise.get("failed", 1) == 0
            t: dict[str, Any] = {}
            hit, p90 = precise.get("hit_rate"), precise.get("ttft_p90_ms")
            if oracle and hit is not None:
                t["precise_share_of_oracle"] = round(hit / oracle, 3)
                t["meets_oracle"] = hit / oracle >= TARGET_ORACLE_SHARE
            if clair and p90:
                t["precise_over_clairvoyant"] = round(p90 / clair, 3)
                t["meets_clairvoyant"] = p90 / clair <= TARGET_OVER_CLAIRVOYANT
            for other in ("approximate", "least_loaded", "precise_remote"):
                o = med.get(other, {}).get("ttft_p90_ms")
                if o and p90:
                    t[f"precise_over_{other}_p90"] = round(p90 / o, 3)
                    t[f"not_worse_than_{other}"] = p90 <= o * (1 + spread)
            r = med.get("random", {}).get("ttft_p90_ms")
            if r and p90:
                t["random_over_precise_p90"] = round(r / p90, 2)
            row["targets"] = t
            rows.append(row)
        sustained = [r for r in rows if r["sustained"]]
        heaviest = sustained[-1] if sustained else None
        workloads[workload] = {
            "rates": rows,
            "heaviest_sustained_factor": heaviest["factor"] if heaviest else None,
            "random_over_precise_at_heaviest": (
                heaviest["targets"].get("random_over_precise_p90") if heaviest else None
            ),
            "meets_random_at_heaviest": bool(
                heaviest
                and (heaviest["targets"].get("random_over_precise_p90") or 0) >= TARGET_VS_RANDOM
            ),
        }
    tokenize: dict[str, Any] = {"local_in_process": _local_tokenize_bench(args)}
    for kind, policy in (("local", "precise"), ("remote", "precise_remote")):
        seen = [
            run["tokenize"][kind]
            for by_rate in per.values()
            for policies in by_rate
            for run in policies.get(policy, [])
            if run["tokenize"][kind]["count"]
        ]
        tokenize[f"{kind}_per_run_gateway_histogram"] = seen
    return {
        "bench": "routing_sweep",
        "gateways": args.gateways,
        "replicas": args.replicas,
        "num_blocks": args.num_blocks,
        "block_size": args.block_size,
        "kv_capacity_tokens_total": capacity_tokens,
        "time_scale": args.time_scale,
        "sim_tokenizer": args.sim_tokenizer,
        "factors": factors,
        "repeats": args.repeats,
        "shared_prefix": {
            "groups": args.groups,
            "users": args.users,
            "system_tokens": args.system_tokens,
            "requests": args.requests,
            "base_rate_per_s": args.rate,
            "working_set_over_capacity": round(
                args.groups * args.system_tokens / capacity_tokens, 2
            ),
        },
        "multi_turn": {
            "conversations": args.conversations,
            "turns": args.turns,
            "base_chat_rate_per_s": args.chat_rate,
        },
        "workloads": workloads,
        "tokenize": tokenize,
        "target_levels": {
            "precise_share_of_oracle": TARGET_ORACLE_SHARE,
            "precise_over_clairvoyant_p90": TARGET_OVER_CLAIRVOYANT,
            "random_over_precise_p90_at_heaviest_sustained": TARGET_VS_RANDOM,
            "local_tokenize_p99_ms": 2.0,
        },
        "wall_s": round(wall_s, 1),
    }


def _sweep_chart(report: dict[str, Any], path: Path) -> None:
    """TTFT p90 and hit rate against offered rate, one line per policy, per workload; the
    clairvoyant replay's p90 and the oracle's hit rate dashed (as llm-d charts its sweeps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["workloads"])
    fig, axes = plt.subplots(2, len(names), figsize=(6 * len(names), 8), squeeze=False)
    for col, workload in enumerate(names):
        rows = report["workloads"][workload]["rates"]
        x = [r["offered_rate_per_s"] for r in rows]
        policies = sorted({p for r in rows for p in r["policies"]})
        for policy in policies:
            p90 = [r["policies"].get(policy, {}).get("ttft_p90_ms") for r in rows]
            hit = [r["policies"].get(policy, {}).get("hit_rate") for r in rows]
            axes[0][col].plot(x, p90, marker="o", label=policy)
            axes[1][col].plot(x, hit, marker="o", label=policy)
        axes[0][col].plot(x, [r["clairvoyant_ttft_p90_ms"] for r in rows], "k--",
                          label="clairvoyant replay")  # fmt: skip
        axes[1][col].plot(x, [r["oracle_hit_rate"] for r in rows], "k--", label="oracle")
        axes[0][col].set_title(f"{workload}: TTFT p90")
        axes[0][col].set_ylabel("ms (wall clock)")
        axes[0][col].set_yscale("log")
        axes[1][col].set_title(f"{workload}: prefix-cache hit rate")
        axes[1][col].set_ylim(0, 1)
        for row in axes:
            row[col].set_xlabel("offered rate (per modelled second)")
            row[col].grid(True, alpha=0.3)
            row[col].legend(fontsize=7)
    fig.suptitle(
        f"llmgw routing sweep: {report['replicas']} sim replicas x {report['num_blocks']} "
        f"blocks, {report['gateways']} gateways, time scale {report['time_scale']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every policy (new traces each time); targets are judged on the medians",
    )
    p.add_argument(
        "--dump", type=Path, default=None, help="append one JSON line per request to this file"
    )
    p.add_argument(
        "--gateway-env",
        nargs="*",
        default=[],
        metavar="LLMGW_GATEWAY__X=V",
        help="extra settings for both control planes (e.g. LLMGW_GATEWAY__TOKENIZE_TIMEOUT_S=0.1)",
    )
    g = p.add_argument_group("shared_prefix")
    g.add_argument("--groups", type=int, default=16)
    g.add_argument("--users", type=int, default=8)
    g.add_argument("--working-set", type=float, default=1.75, help="system prompts / capacity")
    g.add_argument("--system-tokens", type=int, default=0, help="0: from --working-set")
    g.add_argument("--question-tokens", type=int, default=40)
    g.add_argument("--output-tokens", type=int, default=8)
    g.add_argument("--rate", type=float, default=7.0, help="requests/s (Poisson), in modelled time")
    g.add_argument("--requests", type=int, default=320)
    m = p.add_argument_group("multi_turn")
    m.add_argument("--conversations", type=int, default=24)
    m.add_argument("--turns", type=int, default=6)
    m.add_argument("--chat-system-tokens", type=int, default=200)
    m.add_argument("--turn-tokens", type=int, default=120)
    m.add_argument("--chat-output-tokens", type=int, default=24)
    m.add_argument(
        "--chat-rate", type=float, default=2.0, help="conversation starts/s, in modelled time"
    )
    m.add_argument("--think-s", type=float, default=1.0, help="in modelled time")
    s = p.add_argument_group("sweep")
    s.add_argument(
        "--sweep",
        nargs="*",
        type=float,
        default=None,
        metavar="FACTOR",
        help="run every policy at these multiples of --rate and --chat-rate (no values: "
        "0.25 0.5 1 1.5 2); JSON per rate with the oracle and the clairvoyant replay",
    )
    s.add_argument("--sweep-png", type=Path, default=Path("routing-sweep.png"),
                   help="the chart of a sweep")  # fmt: skip
    p.add_argument(
        "--sim-tokenizer",
        default="tiny",
        help="the simulators' --tokenizer (tiny: the packaged tiny model, whose files the "
        "agent ships to the gateways; builtin: the constructed vocabulary, remote only)",
    )
    args = p.parse_args(argv)
    _TOKENIZER["name"] = args.sim_tokenizer
    args.tokens_per_word = _tokens_per_word(args.sim_tokenizer)
    if args.sweep is not None:
        args.sweep = args.sweep or [0.25, 0.5, 1.0, 1.5, 2.0]
        result = sweep(args)
        print(json.dumps(result, indent=2))
        return result
    result = run(args)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    from llmgw.logs import configure_logging

    # Logs to stderr, warnings only: stdout carries the JSON report alone.
    configure_logging("warning")
    main()
