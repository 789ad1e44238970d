"""vLLM itself (its CPU build) through the whole product: the README's "vLLM on the CPU" example
run as written (`llmgw up` with the `vllm` launcher on its PATH, a tiny random-weight model and
two LoRA adapters made here, config/vllm-cpu.yaml applied), then what a fleet of real vLLM
replicas must do behind llmgw, on that one `llmgw up` (two replicas on `gpu_class: cpu`, KV
events, block size 32), shared by the tests below in order to keep CI lean:

- precise routing from vLLM's own KV events: a repeated prompt lands on the replica holding it,
  confirmed by vLLM's own ``cached_tokens``;
- the control plane's index equals the blocks vLLM published, read back from vLLM's own replay
  ROUTER from its first batch (after a burst, after an engine's and an agent's ``kill -9``);
- the gateway's local tokenizing equals vLLM's ``/tokenize``, for completions and chats, and
  its self-verification finds no mismatch;
- adapters by name: llmgw hashes an adapter's blocks as vLLM does (vLLM's events carry the
  adapter's name in ``lora_name``/``extra_keys``), so repeats are precise hits, and the base
  model's requests score none of the adapter's blocks;
- OpenAI's Responses through two gateways of the cluster (the control plane's public listener
  and a `llmgw gateway` process of its own): a conversation chained by ``previous_response_id``,
  each turn entering either gateway, answered every time by the replica storing it (the
  gateways' signed ids name it: no shared state); Anthropic's Messages through the anthropic
  SDK, streamed and not;
- ``kill -9`` of a vLLM server: restarted, serving, its index cleared and refilled, and a
  follow-up to a response it stored refused by name, never answered by another replica;
  ``kill -9`` of the agent: the same engine pids, no failed request;
- a profile edit rolls the replicas one at a time with no failed request under steady load.

vLLM starts in about a minute here (``--enforce-eager``). The module runs whole on one
pytest-xdist worker, scheduled first (tests/conftest.py), so the rest of the suite runs beside
it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from llmgw.kv import (
    BlockRemoved,
    BlockStored,
    block_hashes,
    decode_batch,
    decode_replay_reply,
    encode_replay_request,
    hash64,
)
from llmgw.kv.hf_tokenizer import HfTokenizer, TokenizerFiles
from tests.conftest import pg_dir
from tests.support.procs import free_port, llmgw_cmd, stop_process
from tests.support.waiting import WaitTimeout, wait_for
from tests.up.up_harness import Up, shard_marker

pytestmark = [
    pytest.mark.real_engine,
    pytest.mark.e2e,
    pytest.mark.timeout(600),
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "local-vllm"
ADAPTER = "tiny-lora-a"
BLOCK = 32  # config/vllm-cpu.yaml's kv_block_size
_START_S = 420  # two vLLM replicas starting at once on 2 busy cores


def _readme_blocks() -> list[str]:
    """The fenced shell blocks of the README's "vLLM on the CPU" section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## vLLM on the CPU\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, flags=re.S)


# --- the shared `llmgw up` ---------------------------------------------------------------


@dataclass
class VllmUp:
    up: Up
    info: dict[str, Any]
    tmp: Path
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.info['admin_token']}"}

    def chat(self, model: str, content: str, max_tokens: int = 2) -> httpx.Response:
        return self.http.post(
            f"{self.info['base_url']}/chat/completions",
            headers={"Authorization": f"Bearer {self.info['api_key']}"},
            json={
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
            },
        )

    def cached(self, model: str, content: str) -> tuple[int, int]:
        """(prompt_tokens, cached_tokens) of a chat, as vLLM itself reports them."""
        r = self.chat(model, content)
        assert r.status_code == 200, r.text[:500]
        usage = r.json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    def shards(self) -> list[dict[str, Any]]:
        """The deployment's live shards (released ones left out)."""
        r = self.http.get(
            f"{self.info['admin_url']}/admin/v1/replicas",
            params={"limit": 500},
            headers=self.admin,
        )
        r.raise_for_status()
        return [
            {**s, "replica": rep["id"]}
            for rep in r.json()["items"]
            if rep["deployment"] == MODEL
            for s in rep["shards"]
            if not s["released"]
        ]

    def ready_shards(self) -> list[dict[str, Any]]:
        return [s for s in self.shards() if s["observed_state"] == "ready"]

    def index(self, shard: str) -> dict[str, Any] | None:
        r = self.http.get(f"{self.info['admin_url']}/admin/v1/debug/kv/{shard}", headers=self.admin)
        return r.json() if r.status_code == 200 else None

    def metric(self, name: str, *, sample: str = "_total", **labels: str) -> float:
        """A counter's total (a histogram's ``sample="_count"``) over the samples with
        ``labels``: the gateway's metrics, which the control plane serves as its own."""
        text = self.http.get(f"{self.info['admin_url']}/metrics").text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            if f.name == name
            for s in f.samples
            if s.name == f"{name}{sample}" and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def metric_reaches(
        self, name: str, value: float, *, sample: str = "_total", **labels: str
    ) -> float:
        """The counter once it reaches ``value``: the control plane serves the gateway
        process's metrics as they were at its last read of them, a few seconds old."""
        seen = [0.0]

        def reached() -> float | bool:
            seen[0] = self.metric(name, sample=sample, **labels)
            return seen[0] >= value and seen[0]

        try:
            return float(wait_for(reached, timeout_s=30, what=f"{name}{labels}", interval_s=0.5))
        except WaitTimeout:
            raise AssertionError(
                f"{name}{labels} is {seen[0]}, never {value} within 30 s"
            ) from None

    def record(self, shard: str) -> dict[str, Any]:
        """The agent's record of a shard (its ports, its launch spec)."""
        path = self.up.data_dir / "agent" / "shards" / shard / "record.json"
        data: dict[str, Any] = json.loads(path.read_text())
        return data


@pytest.fixture(scope="module")
def vllm(vllm_cpu: Path) -> Iterator[VllmUp]:
    with pg_dir() as root:
        yield from _vllm_up(vllm_cpu, root)


def _vllm_up(vllm_cpu: Path, root: Path) -> Iterator[VllmUp]:
    xdg, tmp = root / "xdg", root / "tmp"
    tmp.mkdir()
    # The README's data dir: `llmgw apply` and `llmgw status` find `up` through it unasked.
    up = Up(data_dir=xdg / "llmgw", log_dir=root, port=free_port(), admin_port=free_port())
    start, apply = _readme_blocks()
    assert "scripts/install-vllm-cpu.sh" in start and "llmgw up" in start
    up.start(
        env={
            "PATH": f"{vllm_cpu}:{os.environ.get('PATH', '')}",
            "XDG_DATA_HOME": str(xdg),
            # A drained replica is stopped at its drain deadline (30 s by default), whether or
            # not requests still run on it; the roll test's replacements need not wait so long.
            "LLMGW_CONTROLPLANE__RECONCILE__DRAIN_TIMEOUT_S": "10",
            # vLLM's CPU worker busy-polls a core for a second after every step, so two of
            # them starve the gateway's tokenizing workers on this 2-core machine: past the
            # default budgets (50 ms local, 20 ms remote, sized for a gateway on cores of its
            # own) precise routing falls back to the approximate tier, which a stale load
            # reading may send elsewhere ("approximate/overloaded", seen in CI).
            "LLMGW_GATEWAY__LOCAL_TOKENIZE_TIMEOUT_S": "2",
            "LLMGW_GATEWAY__TOKENIZE_TIMEOUT_S": "2",
        }
    )
    try:
        info = up.wait_up()
        # The README's second block, verbatim, in a shell as a reader has one: no llmgw
        # settings of the test's, the venv activated by the block itself.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env |= {"TMPDIR": str(tmp), "XDG_DATA_HOME": str(xdg)}
        ran = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", apply],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert ran.returncode == 0, f"the README's block failed:\n{ran.stdout}\n{ran.stderr}"
        v = VllmUp(up, info, tmp)
        wait_for(
            lambda: len(v.ready_shards()) == 2 and v.chat(MODEL, "Hello").status_code == 200,
            timeout_s=_START_S,
            what="both vLLM replicas ready and answering",
            interval_s=2,
        )
        yield v
    finally:
        assert up.stop(timeout_s=120) == 0, up.logs()


# --- what vLLM published, from its own replay ROUTER ---------------------------------------


def _published(port: int) -> tuple[dict[tuple[int, str], int], list[Any]]:
    """Every batch the engine's replay buffer holds, from its first: the blocks they leave held,
    as reference counts per (uint64 hash, medium), and the events themselves."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    held: Counter[tuple[int, str]] = Counter()
    events: list[Any] = []
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(encode_replay_request(0))
        while True:
            assert sock.poll(5000), f"vLLM's replay ROUTER on port {port} did not answer"
            reply = decode_replay_reply(sock.recv_multipart())
            if reply.is_end:
                break
            for e in decode_batch(reply.payload).events:
                events.append(e)
                if isinstance(e, BlockStored | BlockRemoved):
                    for h in e.block_hashes:
                        key = (h if isinstance(h, int) else hash64(h), e.medium or "GPU")
                        held[key] += 1 if isinstance(e, BlockStored) else -1
                else:  # AllBlocksCleared
                    held.clear()
    finally:
        sock.close()
    return +held, events


def _disagreement(v: VllmUp, shard: str) -> str | None:
    """None when the control plane's index of ``shard`` equals what its vLLM published."""
    held, _ = _published(int(v.record(shard)["kv_replay_port"]))
    want: dict[str, list[int]] = {}
    for h, medium in held:
        want.setdefault(medium, []).append(h)
    want = {m: sorted(hs) for m, hs in want.items()}
    view = v.index(shard)
    if view is None:
        return "the control plane holds no view of it"
    if view["partial"] or not view["complete"]:
        return f"its view is partial={view['partial']} complete={view['complete']}"
    got = {m: hs for m, hs in view["blocks"].items() if hs}
    if got != want:
        sizes = {m: len(h) for m, h in got.items()}, {m: len(h) for m, h in want.items()}
        return f"the index holds {sizes[0]} blocks, vLLM published {sizes[1]}"
    return None


def _agree(v: VllmUp, what: str, timeout_s: float = 30) -> None:
    for s in v.ready_shards():
        wait_for(
            lambda s=s: _disagreement(v, s["id"]) is None,
            timeout_s=timeout_s,
            what=f"the index of shard {s['id']} to equal vLLM's published blocks {what}",
            interval_s=0.5,
        )


def _prompt(tag: str, sentences: int = 10) -> str:
    """A prompt of several 32-token blocks, its opening unique to ``tag``."""
    body = " ".join(
        f"Sentence {i} of {tag}: a fleet of machines serves a model to many users."
        for i in range(sentences)
    )
    return f"[{tag}] {body}"


def _routing_report(v: VllmUp) -> str:
    """What the gateway process says of its routing, for a failed assertion: its metrics,
    read from its private listener (the control plane's copy is a few seconds old), and the
    warnings in its log."""
    log = v.up.data_dir / "logs" / "gateway.log"
    lines = log.read_text(errors="replace").splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    text = _gateway_metrics(v)
    wanted = (
        "llmgw_prefix_decisions",
        "llmgw_prefix_tokenize_failures",
        "llmgw_prefix_tokenizer_mode",
        "llmgw_prefix_tokenizer_mismatches",
        "llmgw_gateway_upstream_errors",
        "llmgw_gateway_retries",
        "llmgw_gateway_ejections",
    )
    report = [
        f"{s.name}{s.labels} = {s.value}"
        for f in text_string_to_metric_families(text)
        if f.name in wanted
        for s in f.samples
        if not s.name.endswith("_created")
    ]
    shards = [(s["id"], s["observed_state"]) for s in v.shards()]
    warned = [str(e) for e in entries if e.get("level") in ("warning", "error")][-20:]
    return "\n".join([f"shards: {shards}", *report, *warned])


def _gateway_metrics(v: VllmUp) -> str:
    """The gateway process's own metrics, from its private listener."""
    log = v.up.data_dir / "logs" / "gateway.log"
    lines = log.read_text(errors="replace").splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    url = [e["private_url"] for e in entries if e.get("event") == "gateway_starting"][-1]
    return v.http.get(f"{url}/metrics").text


def _decisions(v: VllmUp) -> dict[str, float]:
    """The gateway's routing decisions so far, by method and outcome."""
    return {
        f"{s.labels.get('method')}/{s.labels.get('outcome')}": s.value
        for f in text_string_to_metric_families(_gateway_metrics(v))
        if f.name == "llmgw_prefix_decisions"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("model") == MODEL
    }


def _held_share(prompt_tokens: int, cached: int) -> bool:
    # vLLM caches whole blocks and always computes the prompt's last token.
    return cached >= BLOCK * ((prompt_tokens - 1) // BLOCK)


# --- the tests, in order -----------------------------------------------------------------------


def test_the_readme_example_serves_chat_completions_streams_and_adapters(vllm: VllmUp) -> None:
    key = {"Authorization": f"Bearer {vllm.info['api_key']}"}
    r = vllm.chat(MODEL, "Hi there", max_tokens=4)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MODEL and 1 <= body["usage"]["completion_tokens"] <= 4
    r = vllm.http.post(
        f"{vllm.info['base_url']}/completions",
        headers=key,
        json={"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 3},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 0
    with vllm.http.stream(
        "POST",
        f"{vllm.info['base_url']}/chat/completions",
        headers=key,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count"}],
            "max_tokens": 4,
            "stream": True,
        },
    ) as s:
        assert s.status_code == 200
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3, lines
    r = vllm.chat(ADAPTER, "Hi there", max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == ADAPTER


def test_repeated_prompts_land_on_the_replica_holding_them(vllm: VllmUp) -> None:
    hits = vllm.metric("llmgw_prefix_decisions", model=MODEL, method="precise", outcome="hit")
    prompts = [_prompt(f"routing-{i}") for i in range(6)]
    for p in prompts:
        vllm.cached(MODEL, p)
    # The first pass's blocks indexed (the gateways get the same deltas as the control plane):
    # otherwise a repeat is routed by the claims of the approximate tier, correctly but not
    # precisely, and a loaded machine's relay can lag that long.
    _agree(vllm, "after the first pass")
    # Each repeat must find its blocks: over two replicas, chance would miss half of them.
    for i, p in enumerate(prompts * 2):
        before = _decisions(vllm)
        n, cached = vllm.cached(MODEL, p)
        if not (n > 4 * BLOCK and _held_share(n, cached)):
            after = _decisions(vllm)
            made = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k)}
            pytest.fail(
                f"repeat {i} ({p[:20]!r}): {cached} of {n} prompt tokens cached; the gateway's "
                f"decision for it: {made}\n{_routing_report(vllm)}"
            )
    vllm.metric_reaches(
        "llmgw_prefix_decisions", hits + 12, model=MODEL, method="precise", outcome="hit"
    )
    _agree(vllm, "after a burst")


def test_the_gateways_tokens_are_vllms(vllm: VllmUp) -> None:
    shard = vllm.ready_shards()[0]
    model_dir = Path(vllm.record(shard["id"])["spec"]["profile"]["model_path"])
    files = {n: (model_dir / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}
    local = HfTokenizer(TokenizerFiles(files))
    engine = f"http://127.0.0.1:{shard['http_port']}/tokenize"
    texts = [
        "Hello, world!",
        "  leading spaces and\ttabs\nand newlines  ",
        "Unicode: café, naïve, 日本語, emoji 🚀.",
        "<|im_start|>user\nspecial tokens written as text<|im_end|>",
        _prompt("tokens"),
    ]
    for text in texts:
        want = vllm.http.post(engine, json={"model": MODEL, "prompt": text}).json()["tokens"]
        assert local.request_ids({"prompt": text}, chat=False) == want, text
        messages = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": text},
        ]
        want = vllm.http.post(engine, json={"model": MODEL, "messages": messages}).json()
        assert local.request_ids({"messages": messages}, chat=True) == want["tokens"], text
    # The gateway verifies its local tokens against a replica's /tokenize: none differed.
    local = "llmgw_prefix_tokenize_local_seconds"
    local_before = vllm.metric(local, sample="_count")
    for i in range(3):
        assert vllm.chat(MODEL, _prompt(f"verify-{i}")).status_code == 200
    vllm.metric_reaches(local, local_before + 3, sample="_count")
    assert vllm.metric("llmgw_prefix_tokenizer_mismatches") == 0
    mode = vllm.http.get(f"{vllm.info['admin_url']}/metrics").text
    assert f'llmgw_prefix_tokenizer_mode{{mode="local",model="{MODEL}"}} 1.0' in mode


def test_adapter_blocks_are_hashed_as_vllm_hashes_them(vllm: VllmUp) -> None:
    prompt = _prompt("adapter")
    hits = vllm.metric("llmgw_prefix_decisions", model=ADAPTER, method="precise", outcome="hit")
    vllm.cached(ADAPTER, prompt)
    for _ in range(2):
        n, cached = vllm.cached(ADAPTER, prompt)
        assert _held_share(n, cached), (n, cached)
    vllm.metric_reaches(
        "llmgw_prefix_decisions", hits + 2, model=ADAPTER, method="precise", outcome="hit"
    )
    # vLLM's own events for the adapter's blocks: named, and hashed as llmgw hashes them.
    shard = vllm.ready_shards()[0]
    spec = vllm.record(shard["id"])["spec"]
    paths = {a["name"]: a["path"] for a in spec["profile"]["adapters"]}
    seed = spec["profile"]["kv_hash"]["seed"]
    stored = [
        e
        for s in vllm.ready_shards()
        for e in _published(int(vllm.record(s["id"])["kv_replay_port"]))[1]
        if isinstance(e, BlockStored) and e.lora_name == ADAPTER
    ]
    assert stored, "vLLM published no block of the adapter"
    for e in stored:
        assert e.extra_keys is not None and all(k == (ADAPTER,) for k in e.extra_keys), e
        if e.parent_block_hash is None:  # a chain from the prompt's start: hashable alone
            ours = [
                hash64(d)
                for d in block_hashes(
                    list(e.token_ids), BLOCK, seed=seed, lora_name=ADAPTER,
                    lora_path=paths[ADAPTER],
                )
            ]  # fmt: skip
            assert ours == list(e.block_hashes)
    # The base model's request for the same prompt scores none of the adapter's blocks: a
    # precise miss, and vLLM computes it whole.
    labels = {"model": MODEL, "method": "precise"}
    misses = vllm.metric("llmgw_prefix_decisions", outcome="miss", **labels)
    hits = vllm.metric("llmgw_prefix_decisions", outcome="hit", **labels)
    n, cached = vllm.cached(MODEL, prompt)
    assert cached == 0, (n, cached)
    vllm.metric_reaches("llmgw_prefix_decisions", misses + 1, outcome="miss", **labels)
    assert vllm.metric("llmgw_prefix_decisions", outcome="hit", **labels) == hits


def test_an_adapter_applied_at_runtime_is_loaded_into_vllm_without_a_restart(
    vllm: VllmUp,
) -> None:
    runtime = "tiny-lora-runtime"
    pids = {s["id"]: _engine_pids(s["id"]) for s in vllm.ready_shards()}
    spec = vllm.record(next(iter(pids)))["spec"]
    # Adapter a's weights under another name: vLLM loads them as a new adapter.
    path = {a["name"]: a["path"] for a in spec["profile"]["adapters"]}[ADAPTER]
    vllm.up.cli(
        "apply", "-f", "-", stdin=f"kind: adapter\nname: {runtime}\nmodel: {MODEL}\npath: {path}\n"
    )
    # Held while the leader places it and the agent loads it into the running vLLM.
    r = vllm.chat(runtime, _prompt("runtime adapter"), max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == runtime
    assert {s: _engine_pids(s) for s in pids} == pids  # loaded, not restarted
    # vLLM computed its blocks as the adapter's: its events name it.
    named = [
        e
        for s in vllm.ready_shards()
        for e in _published(int(vllm.record(s["id"])["kv_replay_port"]))[1]
        if isinstance(e, BlockStored) and e.lora_name == runtime
    ]
    assert named and all(k == (runtime,) for e in named for k in e.extra_keys or ()), named[:2]
    # Deleted: unloaded from vLLM (its shards report nothing of it), and its name is a 404.
    r = vllm.http.delete(
        f"{vllm.info['admin_url']}/admin/v1/adapters/{runtime}", headers=vllm.admin
    )
    assert r.status_code in (200, 204), r.text

    def unloaded() -> bool:
        r = vllm.http.get(
            f"{vllm.info['admin_url']}/admin/v1/replicas", params={"limit": 500}, headers=vllm.admin
        )
        held = {
            a["name"] for rep in r.json()["items"] for s in rep["shards"] for a in s["adapters"]
        }
        return runtime not in held and vllm.chat(runtime, "gone?").status_code == 404

    wait_for(unloaded, timeout_s=60, what=f"{runtime} unloaded from vLLM, then a 404")
    assert {s: _engine_pids(s) for s in pids} == pids


_LOAD_PAUSE_S = 1.2


@dataclass
class _Load:
    """Chats sent one after another until stopped, every answer's status kept."""

    v: VllmUp
    statuses: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> _Load:
        def run() -> None:
            i = 0
            with httpx.Client(timeout=120) as http:
                while not self._stop.is_set():
                    i += 1
                    try:
                        r = http.post(
                            f"{self.v.info['base_url']}/chat/completions",
                            headers={"Authorization": f"Bearer {self.v.info['api_key']}"},
                            json={
                                "model": MODEL if i % 2 else ADAPTER,
                                "messages": [{"role": "user", "content": f"steady load {i}"}],
                                "max_tokens": 2,
                            },
                        )
                        self.statuses[str(r.status_code)] += 1
                        if r.status_code != 200:
                            self.failures.append(f"{r.status_code}: {r.text[:200]}")
                    except httpx.HTTPError as exc:
                        self.statuses[type(exc).__name__] += 1
                        self.failures.append(repr(exc))
                    # Steady, not saturating: vLLM's worker busy-polls its queue for 1 s after
                    # each step (shm_broadcast's SpinCondition), so back-to-back requests hold a
                    # core at 100% and a replacement vLLM then needs over two minutes to start
                    # on what is left of this 2-core machine.
                    self._stop.wait(_LOAD_PAUSE_S)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=150)

    def answered(self) -> int:
        return self.statuses["200"]


def _engine_pids(shard: str) -> list[int]:
    """The pids of a shard's engine processes (the agent marks each with its shard id)."""
    return sorted(
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and shard_marker(p.name) == shard
    )


def _api_server(shard: str) -> int:
    for pid in _engine_pids(shard):
        cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        if b"serve" in cmd:
            return pid
    raise AssertionError(f"no `vllm serve` process carries shard {shard}'s marker")


@pytest.fixture(scope="module")
def second_gateway(vllm: VllmUp) -> Iterator[str]:
    """Another gateway of the cluster: a `llmgw gateway` process on its own port, reading the
    same database (as a second machine behind a balancer would): its base URL."""
    password = (vllm.up.data_dir / "postgres.app.password").read_text().strip()
    url = make_url(vllm.info["database_url"]).set(password=password)
    port = free_port()
    log = vllm.up.log_dir / "second-gateway.log"
    env = {
        **os.environ,
        "LLMGW_CONTROLPLANE__DATABASE_URL": url.render_as_string(hide_password=False),
        "LLMGW_LOG__JSON": "true",
    }
    argv = llmgw_cmd("gateway", "--host", "127.0.0.1", "--port", str(port), "--workers", "1")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        base = f"http://127.0.0.1:{port}/v1"
        key = {"Authorization": f"Bearer {vllm.info['api_key']}"}

        def serves() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the second gateway exited:\n{log.read_text()[-3000:]}")
            try:
                r = httpx.get(f"{base}/models", headers=key, timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and MODEL in {m["id"] for m in r.json()["data"]}

        wait_for(serves, timeout_s=60, what="the second gateway to serve the model")
        yield base
    finally:
        stop_process(proc)
    # A secret is never written to its log (the database password came in its environment).
    assert password not in log.read_text()


_ANSWERED = ("completed", "incomplete")


def _replica_of(response_id: str) -> str:
    """The replica a gateway's response id names (signed, not encrypted: the payload is
    readable, apis/response_ids.py)."""
    raw = base64.urlsafe_b64decode(response_id.removeprefix("resp_") + "==")
    return raw[2 : 2 + raw[1]].decode()


def _openai(base_url: str, vllm: VllmUp) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=vllm.info["api_key"], max_retries=0)


def test_a_responses_conversation_follows_its_replica_through_either_gateway(
    vllm: VllmUp, second_gateway: str
) -> None:
    gateways = [_openai(vllm.info["base_url"], vllm), _openai(second_gateway, vllm)]
    first = gateways[0].responses.create(
        model=MODEL, input=_prompt("responses-turn-1", 4), max_output_tokens=4
    )
    # (Stopped at max_output_tokens, a random-weight model's answers are "incomplete".)
    assert first.status in _ANSWERED and first.id.startswith("resp_")
    replica = _replica_of(first.id)
    assert replica in {s["replica"] for s in vllm.ready_shards()}
    chain, inputs = [first], [first.usage.input_tokens if first.usage else 0]
    # Turns 2 and 3 enter the other gateway, then the first again; vLLM prepends the stored
    # conversation only on the replica that stored it (anywhere else: "not found").
    for turn, gw in ((2, gateways[1]), (3, gateways[0])):
        got = gw.responses.create(
            model=MODEL,
            input=f"Turn {turn}: and then?",
            previous_response_id=chain[-1].id,
            max_output_tokens=4,
        )
        assert got.status in _ANSWERED, got
        assert _replica_of(got.id) == replica
        assert got.previous_response_id == chain[-1].id  # the engine's id wrapped back
        chain.append(got)
        inputs.append(got.usage.input_tokens if got.usage else 0)
    # Each turn's prompt holds the turns before it: the replica read its stored responses.
    assert inputs[0] < inputs[1] < inputs[2], inputs
    # Streamed through the second gateway, chained on the third turn.
    with gateways[1].responses.stream(
        model=MODEL, input="Turn 4, streamed.", previous_response_id=chain[-1].id,
        max_output_tokens=4,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_response()
    assert streamed.status in _ANSWERED and _replica_of(streamed.id) == replica
    # Retrieved through either gateway: the stored response, by the replica holding it.
    for gw in gateways:
        again = gw.responses.retrieve(streamed.id)
        assert again.id == streamed.id and again.output_text == streamed.output_text
    # A forged id (one character changed) is refused by the gateway, not by an engine.
    forged = streamed.id[:-2] + ("A" if streamed.id[-2] != "A" else "B") + streamed.id[-1]
    with pytest.raises(openai.NotFoundError) as refused:
        gateways[1].responses.create(
            model=MODEL, input="x", previous_response_id=forged, max_output_tokens=2
        )
    assert "does not match" in str(refused.value) or "not `resp_`" in str(refused.value)
    # Counted under their own api label (the gateway's metrics, as the control plane serves
    # them: the second gateway's are its own).
    vllm.metric_reaches("llmgw_gateway_api_requests", 3, api="responses", status="200")


def test_anthropic_messages_through_the_sdk_streamed_and_not(vllm: VllmUp) -> None:
    client = anthropic.Anthropic(
        base_url=vllm.info["base_url"].removesuffix("/v1"),
        api_key=vllm.info["api_key"],  # sent as x-api-key, as Anthropic's clients send it
        max_retries=0,
    )
    # Long enough for precise routing (gateway.precise_min_blocks): a short prompt is
    # routed by the approximate tier, which may move a repeat to its home replica.
    prompt = _prompt("messages")
    message = client.messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": prompt}]
    )
    assert message.type == "message" and message.usage.input_tokens > 0
    assert message.usage.output_tokens > 0
    with client.messages.stream(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": prompt}]
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.output_tokens > 0
    # The same prompt again: routed to the replica holding it, which reads it from its cache.
    assert (streamed.usage.cache_read_input_tokens or 0) > 0, streamed.usage
    counted = client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": prompt}]
    )
    # Anthropic's usage splits the prompt: uncached input, written to the cache, read from it.
    u = message.usage
    whole = u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0)
    assert counted.input_tokens == whole, (counted, u)
    # A revoked key sent as x-api-key: refused in Anthropic's error shape.
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=vllm.info["base_url"].removesuffix("/v1"), api_key="sk-not-a-key",
            max_retries=0,
        ).messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])  # fmt: skip


def test_kill_9_of_a_vllm_server_restarts_it_with_its_index_cleared_and_refilled(
    vllm: VllmUp,
) -> None:
    # A response stored by the engine about to be killed: its follow-up must never be
    # answered by another replica, and once the engine is back, be refused by name.
    stored = _openai(vllm.info["base_url"], vllm).responses.create(
        model=MODEL, input="Remember this.", max_output_tokens=2
    )
    victim = next(s for s in vllm.ready_shards() if s["replica"] == _replica_of(stored.id))
    shard = victim["id"]
    assert (vllm.index(shard) or {}).get("num_blocks", 0) > 0
    old = _api_server(shard)
    old_pids = set(_engine_pids(shard))
    os.kill(old, signal.SIGKILL)
    # The index drops the dead engine's blocks (its view is reset) before the new one serves.
    wait_for(
        lambda: (vllm.index(shard) or {"num_blocks": 0})["num_blocks"] == 0,
        timeout_s=60,
        what="the killed engine's blocks to leave the index",
        interval_s=0.5,
    )
    answers: Counter[str] = Counter()

    def follow_up() -> str:
        r = vllm.http.post(
            f"{vllm.info['base_url']}/responses",
            headers={"Authorization": f"Bearer {vllm.info['api_key']}"},
            json={"model": MODEL, "input": "And?", "previous_response_id": stored.id,
                  "max_output_tokens": 2},
        )  # fmt: skip
        code = r.json().get("error", {}).get("code") if r.status_code != 200 else "answered"
        answers[f"{r.status_code} {code}"] += 1
        return str(code)

    def restarted() -> bool:
        follow_up()
        return any(
            s["id"] == shard and s["restarts"] > victim["restarts"] for s in vllm.ready_shards()
        )

    wait_for(
        restarted,
        timeout_s=_START_S,
        what="the agent to restart the killed vLLM server",
        interval_s=2,
    )
    # Back: the gateway knows the new process holds none of the old one's responses.
    wait_for(
        lambda: follow_up() == "response_replica_restarted",
        timeout_s=30,
        what="the follow-up refused as stored by a restarted engine",
        interval_s=0.5,
    )
    # Never another replica's answer, nor the engine's own "not found": while the engine was
    # down the gateway said the replica is gone (or its proxy could not reach it).
    assert set(answers) <= {
        "404 response_replica_gone",
        "404 response_replica_restarted",
        "502 upstream_error",
        "503 upstream_error",
        "503 no_ready_replica",
    }, answers
    # Nothing of the killed server is left behind (its engine core would hold memory and cores).
    assert not old_pids & set(_engine_pids(shard)), (old_pids, _engine_pids(shard))
    # Serving, and the index refills from the new engine's events.
    for i in range(6):
        assert vllm.chat(MODEL, _prompt(f"refill-{i}")).status_code == 200
    wait_for(
        lambda: (vllm.index(shard) or {"num_blocks": 0})["num_blocks"] > 0,
        timeout_s=30,
        what="the restarted engine's blocks in the index",
    )
    _agree(vllm, "after an engine's kill -9")


def test_kill_9_of_the_agent_keeps_every_engine_and_every_request(vllm: VllmUp) -> None:
    children = json.loads((vllm.up.data_dir / "children.json").read_text())
    agent = next(c for c in children if c["name"] == "agent")
    pids = {s["id"]: _engine_pids(s["id"]) for s in vllm.ready_shards()}
    with _Load(vllm) as load:
        wait_for(lambda: load.answered() >= 3, timeout_s=60, what="steady load")
        os.kill(int(agent["pid"]), signal.SIGKILL)

        def new_agent() -> bool:
            now = json.loads((vllm.up.data_dir / "children.json").read_text())
            return any(c["name"] == "agent" and c["pid"] != agent["pid"] for c in now)

        wait_for(new_agent, timeout_s=60, what="`llmgw up` to restart the agent")
        seen = load.answered()
        wait_for(lambda: load.answered() >= seen + 5, timeout_s=90, what="requests after")
    assert not load.failures, load.failures[:5]
    # Adopted, not restarted.
    assert {s: _engine_pids(s) for s in pids} == pids
    _agree(vllm, "after the agent's kill -9 and adoption")


def test_a_profile_edit_rolls_replicas_one_at_a_time_without_a_failed_request(
    vllm: VllmUp,
) -> None:
    before = {s["id"] for s in vllm.ready_shards()}
    document = (ROOT / "config" / "vllm-cpu.yaml").read_text()
    document = document.replace("/models/tiny-hf", str(vllm.tmp / "tiny-hf"))
    edited = document.replace('"2048"]', '"2048", "--max-num-seqs", "32"]')
    assert edited != document
    fewest = 2
    with _Load(vllm) as load:
        wait_for(lambda: load.answered() >= 3, timeout_s=60, what="steady load")
        vllm.up.cli("apply", "-f", "-", stdin=edited)

        def rolled() -> bool:
            nonlocal fewest
            ready = vllm.ready_shards()
            fewest = min(fewest, len(ready))
            ids = {s["id"] for s in ready}
            return len(ids) == 2 and not ids & before

        wait_for(rolled, timeout_s=2 * _START_S, what="both replicas replaced", interval_s=1)
        seen = load.answered()
        wait_for(lambda: load.answered() >= seen + 3, timeout_s=60, what="requests after")
    assert not load.failures, load.failures[:5]
    assert fewest >= 1, "the roll took both replicas down at once"
    assert load.answered() > 20
    status = json.loads(vllm.up.cli("status", "--json"))
    dep = next(d for d in status["deployments"] if d["name"] == MODEL)
    assert dep["rollout"] == "complete" and dep["ready"] == 2, dep
