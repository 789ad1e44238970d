"""Local tokenizing in worker processes (llmgw.tokenizing, gateway.local_tokens, gateway.tokens):
the event loop is not held by a huge render or encode (finding 1), each kind of tokenizer
failure is a reply that falls back to a replica's /tokenize instead of a 500 (finding 3: a
Rust panic, an ``Exception`` from a WordLevel tokenizer without its unk token, a
``ZeroDivisionError`` in a template, ``MemoryError``), a tokenizer that keeps failing is turned
off with its reason, a worker past its deadline is killed and replaced (one that dies idle at
once), files replaced are let go by the workers, a request over the frame cap is never sent,
and a prompt that
renders over the cap or tokenizes past the model's context length is refused with a 400
naming the limit."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from llmgw.config import GatewaySettings
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.load import LoadTracker
from llmgw.gateway.local_tokens import LocalTokenizers
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routes import Endpoint, ModelRoute, RouteTable
from llmgw.gateway.routing.router import HashParams
from llmgw.gateway.tokens import Tokens
from llmgw.gateway.wire import prompt_of
from llmgw.kv.hf_tokenizer import HfTokenizer, TokenizerFiles
from llmgw.simengine.hf_tokens import read_tokenizer_dir, tiny_model_dir
from llmgw.tokenizing.worker import Worker
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(120)

TINY = read_tokenizer_dir(tiny_model_dir())
SMALL_CHAT = {"messages": [{"role": "user", "content": "Hello there, how are you today?"}]}


def _with_template(template: str) -> TokenizerFiles:
    config = json.loads(TINY.files["tokenizer_config.json"])
    config["chat_template"] = template
    return TokenizerFiles({**TINY.files, "tokenizer_config.json": json.dumps(config).encode()})


def _with_tokenizer(**changes: Any) -> TokenizerFiles:
    raw = json.loads(TINY.files["tokenizer.json"])
    raw.update(changes)
    return TokenizerFiles({**TINY.files, "tokenizer.json": json.dumps(raw).encode()})


# A Split regex that hits onig's retry limit on a run of "a"s: a Rust panic (PanicException,
# a BaseException) from encode.
PANICS = _with_tokenizer(
    pre_tokenizer={
        "type": "Split",
        "pattern": {"Regex": "(?:a|aa)+$"},
        "behavior": "Isolated",
        "invert": False,
    }
)
PANIC_BODY = {"prompt": "a" * 5000 + "!"}
# A WordLevel model whose unk token is not in its vocabulary: loads, then every unknown word
# raises.
WORDLEVEL = _with_tokenizer(
    added_tokens=[],
    pre_tokenizer={"type": "Whitespace"},
    post_processor=None,
    decoder=None,
    model={
        "type": "WordLevel",
        "vocab": {"a": 0, "hello": 1, "world": 2, "42": 3},
        "unk_token": "[UNK]",
    },
)
DIVIDES = _with_template("{{ (messages | length) / 0 }}")


def _worker_with(files: TokenizerFiles) -> Worker:
    worker = Worker(None)
    assert worker.handle({"op": "load", "digest": "d", "files": dict(files.files)})["ok"]
    return worker


def _tokenize(worker: Worker, body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    return worker.handle(
        {"op": "tokenize", "digest": "d", "body": body, "chat": chat, "max_chars": 100_000}
    )


def test_every_failure_is_a_reply_naming_it() -> None:
    got = _tokenize(_worker_with(PANICS), PANIC_BODY, chat=False)
    assert (got["ok"], got["kind"]) == (False, "failed") and "PanicException" in got["error"]
    got = _tokenize(_worker_with(WORDLEVEL), {"prompt": "hello zzz"}, chat=False)
    assert got["kind"] == "failed" and "Missing [UNK]" in got["error"]
    got = _tokenize(_worker_with(DIVIDES), SMALL_CHAT, chat=True)
    assert got["kind"] == "failed" and "ZeroDivisionError" in got["error"]
    # A template over its step budget is the template's failure; an output over the cap the
    # request's; a template's own refusal the engine's too.
    loops = _with_template(
        "{% for i in range(15000) %}{% for j in range(15000) %}{% endfor %}{% endfor %}"
    )
    got = _tokenize(_worker_with(loops), SMALL_CHAT, chat=True)
    assert got["kind"] == "failed" and "steps" in got["error"]
    chat = {"messages": [{"role": "user", "content": ""}] * 10_000}
    assert _tokenize(_worker_with(TINY), chat, chat=True)["kind"] == "too_long"
    refuses = _with_template("{{ raise_exception('no system role') }}")
    got = _tokenize(_worker_with(refuses), SMALL_CHAT, chat=True)
    assert got["kind"] == "refused" and "no system role" in got["error"]
    # A role the template cannot concatenate: the body's fault (the engine's 400 too).
    bad = {"messages": [{"role": 5, "content": "hi"}]}
    got = _tokenize(_worker_with(TINY), bad, chat=True)
    assert got["kind"] == "refused" and "messages" in got["error"]
    # MemoryError: a reply, then the worker exits (its heap may be in any state).
    worker = _worker_with(TINY)
    held: HfTokenizer = worker._held["d"]

    def out_of_memory(text: str, *, add_special_tokens: bool) -> list[int]:
        raise MemoryError

    held.encode = out_of_memory  # type: ignore[method-assign]
    got = _tokenize(worker, {"prompt": "hello"}, chat=False)
    assert got["kind"] == "failed" and got["error"].startswith("MemoryError")
    assert worker.exit_after_reply
    ok = _tokenize(_worker_with(TINY), {"prompt": "hello world"}, chat=False)
    assert ok["ok"] and ok["chars"] == 11


def test_an_upload_check_refuses_a_bomb_and_passes_a_refusing_template() -> None:
    worker = Worker(None)
    bomb = _with_template("{{ 'x' * 4000000000 }}")
    got = worker.handle({"op": "check", "files": dict(bomb.files), "max_chars": 1_000_000})
    assert got["kind"] == "failed" and "characters" in got["error"]
    got = worker.handle({"op": "check", "files": dict(WORDLEVEL.files)})
    assert got["kind"] == "failed" and "UNK" in got["error"]
    got = worker.handle({"op": "check", "files": {"tokenizer.json": b"{}"}})
    assert got["kind"] == "files" and "does not load" in got["error"]
    # Gemma-like: the system role refused is the engine's refusal too, not a broken template.
    picky = _with_template(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    assert worker.handle({"op": "check", "files": dict(picky.files)})["ok"]
    assert worker.handle({"op": "check", "files": dict(TINY.files)})["ok"]


async def _loaded(local: LocalTokenizers, files: TokenizerFiles) -> None:
    local.sync({"m": files})
    await local.settled()
    assert local.mode("m") == "local"


@pytest.mark.e2e
async def test_the_loop_is_not_held_and_small_chats_stay_fast() -> None:
    local = LocalTokenizers(timeout_s=60.0, deadline_s=60.0, max_chars=10_000_000, verify_first=0)
    try:
        await _loaded(local, TINY)
        # Tokenized in the worker as in process.
        got = await local.tokenize("m", SMALL_CHAT, chat=True, chars=30)
        assert isinstance(got, tuple)
        assert got[0] == HfTokenizer(TINY).request_ids(SMALL_CHAT, chat=True)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            await local.tokenize("m", SMALL_CHAT, chat=True, chars=30)
            times.append(time.perf_counter() - t)
        p50 = statistics.median(times) * 1000
        hf = HfTokenizer(TINY)
        inline = []
        for _ in range(200):
            t = time.perf_counter()
            hf.request_ids(SMALL_CHAT, chat=True)
            inline.append(time.perf_counter() - t)
        print(
            f"small chat: worker p50 {p50:.3f} ms, in process {statistics.median(inline) * 1000:.3f} ms"
        )
        assert p50 < 20.0

        # 160,000 empty messages (4.5M characters rendered), and a ~1 MB prompt: the loop
        # keeps ticking while the workers render and encode them.
        lags: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)

        task = asyncio.create_task(ticker())
        chat = {"messages": [{"role": "user", "content": ""}] * 160_000}
        got = await local.tokenize("m", chat, chat=True, chars=0)
        assert isinstance(got, tuple) and len(got[0]) > 300_000
        got = await local.tokenize("m", {"prompt": "word " * 200_000}, chat=False, chars=1_000_000)
        assert isinstance(got, tuple)
        stop.set()
        await task
        print(f"worst loop lag while tokenizing: {max(lags) * 1000:.1f} ms")
        assert max(lags) < 0.1
    finally:
        local.close()


@pytest.mark.e2e
async def test_a_failing_tokenizer_falls_back_then_is_turned_off_with_its_reason() -> None:
    local = LocalTokenizers(timeout_s=5.0, verify_first=0, failing_after=3)
    disabled: list[str] = []
    local.on_disabled = disabled.append
    try:
        await _loaded(local, PANICS)
        ok = await local.tokenize("m", {"prompt": "hello world"}, chat=False, chars=11)
        assert isinstance(ok, tuple)
        for _ in range(3):
            got = await local.tokenize("m", PANIC_BODY, chat=False, chars=5001)
            assert got == "failed"
            await asyncio.sleep(0)  # the run's outcome is accounted on its own callback
        assert disabled == ["m"]
        assert local.mode("m") == "remote" and local.failing("m") == "PanicException"
        assert (local.disabled_reason("m") or "").startswith("failing: PanicException")
        assert await local.tokenize("m", {"prompt": "hello"}, chat=False, chars=5) == "unavailable"
        # A body's own faults never count: a refused chat, again and again.
        local2 = LocalTokenizers(timeout_s=5.0, verify_first=0, failing_after=2)
        try:
            await _loaded(local2, _with_template("{{ raise_exception('no') }}"))
            for _ in range(4):
                assert await local2.tokenize("m", SMALL_CHAT, chat=True, chars=30) == "refused"
            assert local2.mode("m") == "local"
        finally:
            local2.close()
    finally:
        local.close()


@pytest.mark.e2e
async def test_a_worker_past_its_deadline_is_killed_and_replaced() -> None:
    local = LocalTokenizers(
        workers=1, timeout_s=0.05, deadline_s=0.3, max_chars=10_000_000, verify_first=0
    )
    try:
        await _loaded(local, TINY)
        pool = local.pool
        (before,) = pool.pids()
        # A ~3 MB prompt takes the tiny tokenizer well over 0.3 s: the worker is killed at
        # 0.3 s, and the request has its answer by then (it waits its deadline at most).
        got = await local.tokenize("m", {"prompt": "word " * 600_000}, chat=False, chars=3_000_000)
        assert got in ("timeout", "failed")
        await until(lambda: pool.kills, timeout_s=5, what="the worker past its deadline killed")
        assert pool.kills == 1

        await until(
            lambda: bool(pool.pids()) and pool.pids()[0] != before and pool.holds(TINY.digest),
            timeout_s=20,
            what="a new worker holds the files",
            interval_s=0.02,
        )
        # The replacement loaded the files before taking a call: tokenizing goes on.
        for _ in range(100):
            got = await local.tokenize("m", SMALL_CHAT, chat=True, chars=30)
            if isinstance(got, tuple):
                break
            await asyncio.sleep(0.05)
        assert isinstance(got, tuple)
    finally:
        local.close()


async def test_a_request_over_the_frame_cap_is_refused_before_any_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llmgw.tokenizing import pool as pool_module

    monkeypatch.setattr(pool_module, "MAX_FRAME_BYTES", 1000)
    pool = pool_module.WorkerPool(workers=1, deadline_s=1.0)
    try:
        got = await pool.call({"op": "ping", "pad": "x" * 2000}, digest=None, wait_s=1.0)
        # Not sent: the worker would die on it, and the death count against the files.
        assert got == "unencodable" and pool.pids() == [] and pool.crashes == 0
    finally:
        await pool.aclose()


@pytest.mark.e2e
async def test_a_worker_that_dies_idle_is_replaced_before_the_next_call() -> None:
    local = LocalTokenizers(workers=1, timeout_s=5.0, verify_first=0, failing_after=1)
    try:
        await _loaded(local, TINY)
        pool = local.pool
        (before,) = pool.pids()
        os.kill(before, signal.SIGKILL)  # the OOM killer's way: no reply, no exit of its own
        await until(
            lambda: bool(pool.pids()) and pool.pids()[0] != before,
            timeout_s=20,
            what="a new worker started in its place",
            interval_s=0.02,
        )
        assert pool.crashes == 1
        # The next call waits for the replacement (it loads the files first), never meets the
        # dead one; nothing counted against the files.
        got = await local.tokenize("m", SMALL_CHAT, chat=True, chars=30)
        assert isinstance(got, tuple)
        assert local.mode("m") == "local" and local.failing("m") is None
    finally:
        local.close()


@pytest.mark.e2e
async def test_files_replaced_are_dropped_by_the_workers() -> None:
    local = LocalTokenizers(workers=2, timeout_s=5.0, verify_first=0)
    try:
        await _loaded(local, TINY)
        newer = _with_template("{{ messages | length }}")
        local.sync({"m": newer})
        await local.settled()
        assert local.digest("m") == newer.digest and local.mode("m") == "local"
        # The old set is let go by every worker (its memory, its share of the cap), not held
        # until a restart: a gateway up for months sees many sets.
        procs = [p for p in local.pool._procs if p is not None]
        await until(
            lambda: all(p.held == {newer.digest} and not p.busy for p in procs),
            timeout_s=20,
            what="the workers hold the new set alone",
        )
        got = await local.tokenize("m", SMALL_CHAT, chat=True, chars=30)
        assert isinstance(got, tuple)
    finally:
        local.close()


class _Files:
    def __init__(self, files: Mapping[str, TokenizerFiles]) -> None:
        self.files = files


class _Remote:
    def __init__(self) -> None:
        self.asked = 0

    async def tokenize(self, ep: Endpoint, payload: Mapping[str, Any], **_: Any) -> list[int]:
        self.asked += 1
        return list(range(300))


def _tokens(files: TokenizerFiles, *, max_chars: int = 1_000_000) -> tuple[Tokens, ModelRoute]:
    settings = GatewaySettings(
        local_tokenize_max_chars=max_chars, tokenizer_verify_first=0, local_tokenize_timeout_s=5
    )
    ep = Endpoint(
        replica="r1",
        shard="s1",
        url="http://127.0.0.1:9",
        api_key="k",
        index_model="m",
        hash=HashParams(seed="0", block_size=16, extra_key_format="tagged"),
        adapters={},
    )
    route = ModelRoute("m", "m", None, (ep,))
    load = LoadTracker(eject_after=3, eject_for_s=5, clock=time.monotonic)
    tokens = Tokens(
        settings,
        metrics=GatewayMetrics.create(CollectorRegistry()),
        load=load,
        files=_Files({"m": files}),
        indexed=True,
        table=lambda: RouteTable({"m": route}, 1.0),
    )
    tokens._remote = _Remote()  # type: ignore[assignment]
    return tokens, route


async def _ids(tokens: Tokens, route: ModelRoute, body: dict[str, Any], chat: bool) -> Any:
    return await tokens.ids(route, route.endpoints, body, prompt_of(body, chat=chat), chat)


@pytest.mark.e2e
async def test_the_gateway_refuses_what_renders_too_long_or_exceeds_the_context() -> None:
    tokens, route = _tokens(TINY, max_chars=100_000)
    try:
        tokens.sync()
        await tokens.local.settled()
        # Its own text is short; rendered, it is 280,000 characters.
        chat = {"messages": [{"role": "user", "content": ""}] * 10_000}
        with pytest.raises(GatewayError) as caught:
            await _ids(tokens, route, chat, chat=True)
        assert caught.value.status == 400
        assert "100000 characters" in str(caught.value) and "local_tokenize_max_chars" in str(
            caught.value
        )
        with pytest.raises(GatewayError, match="is 200000 characters"):
            await _ids(tokens, route, {"prompt": "ab" * 100_000}, chat=False)
        # Past the context length its replicas state.
        long_chat = {"messages": [{"role": "user", "content": "hello world " * 100}]}
        assert len(await _ids(tokens, route, long_chat, chat=True)) > 200
        tokens._load.context["r1"] = 64
        with pytest.raises(GatewayError) as caught:
            await _ids(tokens, route, long_chat, chat=True)
        assert caught.value.status == 400 and "context length of 64 tokens" in str(caught.value)
    finally:
        tokens.close()


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("files", "body", "chat"),
    [
        (PANICS, PANIC_BODY, False),
        (WORDLEVEL, {"prompt": "hello zzz " * 30}, False),
        (DIVIDES, {"messages": [{"role": "user", "content": "x" * 300}]}, True),
    ],
    ids=["panic", "wordlevel", "zerodivision"],
)
async def test_each_failure_falls_back_to_the_replica(
    files: TokenizerFiles, body: dict[str, Any], chat: bool
) -> None:
    tokens, route = _tokens(files)
    try:
        tokens.sync()
        await tokens.local.settled()
        assert await _ids(tokens, route, body, chat) == list(range(300))
        assert tokens._remote.asked == 1  # type: ignore[union-attr]
        metrics = tokens._metrics
        failed = metrics.tokenize_failures.labels("m", "local_failed")._value.get()
        assert failed == 1
    finally:
        tokens.close()


def test_llmgw_status_names_why_a_failing_tokenizer_is_off() -> None:
    from llmgw.commands.status import tokenizer_modes

    text = (
        'llmgw_prefix_tokenizer_mode{model="m",mode="remote"} 1.0\n'
        'llmgw_prefix_tokenizer_mode{model="m",mode="local"} 0.0\n'
        'llmgw_prefix_tokenizer_failing{model="m",reason="PanicException"} 1.0\n'
    )
    assert tokenizer_modes(text) == {"m": "remote (failing: PanicException)"}
