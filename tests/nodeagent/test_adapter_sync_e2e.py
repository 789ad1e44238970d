"""The runtime adapters' shell (llmgw/nodeagent/adapter_sync.py) against a real `llmgw simengine`
with vLLM's runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, --max-cpu-loras): placed
adapters loaded and reported, removed ones unloaded, a missing directory failed with the
engine's reason and loaded once it appears, a restarted engine loaded again, and an adopted one
converged from its own list. The shards are built in the test (no agent process): what is under
test is the shell's calls, answers and reports."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from structlog.testing import capture_logs

from llmgw.engines import EngineRegistry, EnginesConfig, SimConfig
from llmgw.nodeagent.adapter_sync import AdapterSync, AdapterSyncConfig
from llmgw.nodeagent.policy import LocalPolicy
from llmgw.nodeagent.prepare import PreparedShard
from llmgw.nodeagent.records import ShardAdapters, ShardRecord, read_adapters, write_model
from llmgw.nodeagent.runtime import ShardRuntime
from llmgw.protocol import DesiredShard
from llmgw.protocol.sync import AdapterObserved, RuntimeAdapter
from tests.simengine.sim_process import SimProcess, start_sim, stop_sim
from tests.support.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

KEY = "engine-key-0123456789"
SHARD = "lora-shard-1"
SLOTS = 2
ENGINE = EngineRegistry(EnginesConfig(sim=SimConfig(python_executable="python"))).get("sim")


def _sim(tmp: Path, *extra: str) -> SimProcess:
    return start_sim(
        tmp,
        "--served-model-name", "demo",
        "--max-loras", "2",
        "--max-cpu-loras", str(SLOTS),
        "--lora-load-time-s", "0.05",
        "--lora-modules", f"own={tmp}",
        *extra,
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "SIMENGINE_API_KEY": KEY},
    )  # fmt: skip


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimProcess]:
    s = _sim(tmp_path)
    yield s
    stop_sim(s)


def _port(sim: SimProcess) -> int:
    return int(sim.base_url.rsplit(":", 1)[1])


def _runtime(
    tmp: Path, sim: SimProcess, *, generation: int = 1, adapters: list[RuntimeAdapter] | None
) -> ShardRuntime:
    """A live, ready rank-0 sim shard with adapter_slots 2 and its own adapter `own`; placed
    ``adapters`` (None: no desired set yet)."""
    shard_dir = tmp / "shards" / SHARD
    rec = ShardRecord(
        shard_id=SHARD,
        digest="d1",
        spec={"rank": 0, "profile": {"adapter_slots": SLOTS, "adapters": [{"name": "own"}]}},
        engine="sim",
        http_port=_port(sim),
        generation=generation,
        wrapper_pid=sim.proc.pid,
        wrapper_start_time=generation,
    )
    write_model(shard_dir / "record.json", rec)
    prepared = None
    if adapters is not None:
        desired = DesiredShard(
            shard_id=SHARD,
            replica_id="r1",
            fingerprint="fp",
            spec={},
            engine_api_key=KEY,
            adapters=tuple(adapters),
        )
        prepared = PreparedShard(desired, "d1", None, ENGINE)
    return ShardRuntime(
        shard_id=SHARD,
        dir=shard_dir,
        record=rec,
        phase="live",
        engine=ENGINE,
        health="ready",
        prepared=prepared,
    )


def _sync(tmp: Path, *, retry_min_s: float = 0.2, policy: LocalPolicy | None = None) -> AdapterSync:
    cfg = AdapterSyncConfig(
        adapter_root=tmp / "downloads", call_timeout_s=10, retry_min_s=retry_min_s, retry_max_s=2
    )
    return AdapterSync(cfg, policy or LocalPolicy())


def _dir(tmp: Path, name: str) -> str:
    d = tmp / "adapters" / name
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def _engine_holds(sim: SimProcess) -> dict[str, str]:
    r = httpx.get(f"{sim.base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    r.raise_for_status()
    return {m["id"]: m["root"] for m in r.json()["data"] if m.get("parent")}


def _states(sync: AdapterSync) -> dict[str, str]:
    return {a.name: a.state for a in sync.observed().get(SHARD, ())}


async def _converge(sync: AdapterSync, rt: ShardRuntime) -> dict[str, str]:
    sync.follow({SHARD: rt})
    await sync.idle()
    return _states(sync)


async def test_placed_adapters_are_loaded_reported_and_unloaded_when_removed(
    tmp_path: Path, sim: SimProcess
) -> None:
    sync = _sync(tmp_path)
    try:
        sql, chat = _dir(tmp_path, "sql"), _dir(tmp_path, "chat")
        placed = [RuntimeAdapter(name="sql", path=sql), RuntimeAdapter(name="chat", path=chat)]
        rt = _runtime(tmp_path, sim, adapters=placed)
        assert await _converge(sync, rt) == {"sql": "loaded", "chat": "loaded"}
        assert _engine_holds(sim) == {"own": str(tmp_path), "sql": sql, "chat": chat}
        [counts] = sync.counts()
        assert (counts.loads_ok, counts.loads_failed, counts.unloads, counts.loaded) == (2, 0, 0, 2)
        saved = read_adapters(rt.dir)
        assert saved is not None and saved.loaded == {"chat": chat, "sql": sql}
        # Converged: following again calls nothing.
        assert await _converge(sync, rt) == {"sql": "loaded", "chat": "loaded"}
        assert sync.counts()[0].loads_ok == 2

        rt = _runtime(tmp_path, sim, adapters=[RuntimeAdapter(name="chat", path=chat)])
        with capture_logs() as logs:
            assert await _converge(sync, rt) == {"chat": "loaded"}
        # The profile's own adapter is the engine's since its start: never unloaded.
        assert _engine_holds(sim) == {"own": str(tmp_path), "chat": chat}
        assert sync.counts()[0].unloads == 1
        [unloaded] = [e for e in logs if e["event"] == "adapter_unloaded"]
        assert unloaded["adapter"] == "sql" and unloaded["why"] == "no longer placed here"
        assert read_adapters(rt.dir).loaded == {"chat": chat}  # type: ignore[union-attr]
    finally:
        await sync.close()


async def test_a_missing_directory_fails_with_the_engines_reason_and_loads_once_it_appears(
    tmp_path: Path, sim: SimProcess
) -> None:
    sync = _sync(tmp_path, retry_min_s=0.5)
    try:
        ghost = str(tmp_path / "adapters" / "ghost")
        rt = _runtime(tmp_path, sim, adapters=[RuntimeAdapter(name="ghost", path=ghost)])
        with capture_logs() as logs:
            assert await _converge(sync, rt) == {"ghost": "failed"}
        [report] = sync.observed()[SHARD]
        assert report == AdapterObserved(
            name="ghost",
            state="failed",
            reason=f"404: Loading lora ghost failed: No adapter found for {ghost}",
            failures=1,
        )
        [event] = [e for e in logs if e["event"] == "adapter_load_failed"]
        # The operator's to fix: a warning with the reason, no traceback.
        assert event["log_level"] == "warning" and "exc_info" not in event
        assert event["cause"] == "engine" and "No adapter found" in event["reason"]
        # Nothing is tried again before the backoff has passed.
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            await _converge(sync, rt)
        assert sync.counts()[0].loads_failed == 1

        _dir(tmp_path, "ghost")

        async def loaded() -> bool:
            return (await _converge(sync, rt)) == {"ghost": "loaded"}

        await until(loaded, timeout_s=10, what="ghost loaded once its directory exists")
        assert "ghost" in _engine_holds(sim)
        assert sync.observed()[SHARD] == (AdapterObserved(name="ghost", state="loaded"),)
    finally:
        await sync.close()


async def test_a_path_the_node_refuses_fails_without_asking_the_engine(
    tmp_path: Path, sim: SimProcess
) -> None:
    allowed = tmp_path / "allowed"
    sync = _sync(tmp_path, policy=LocalPolicy(allowed_adapter_sources=(str(allowed),)))
    try:
        outside = _dir(tmp_path, "outside")
        rt = _runtime(tmp_path, sim, adapters=[RuntimeAdapter(name="x", path=outside)])
        with capture_logs() as logs:
            assert await _converge(sync, rt) == {"x": "failed"}
        [report] = sync.observed()[SHARD]
        assert report.reason == (
            f"adapter 'x' path {outside!r} is not under an allowed root ({allowed}; "
            "agent.policy.allowed_adapter_sources)"
        )
        [event] = [e for e in logs if e["event"] == "adapter_load_failed"]
        assert event["cause"] == "node" and event["log_level"] == "warning"
        assert "x" not in _engine_holds(sim)
    finally:
        await sync.close()


async def test_more_placed_than_slots_loads_as_many_as_fit(tmp_path: Path, sim: SimProcess) -> None:
    sync = _sync(tmp_path)
    try:
        placed = [RuntimeAdapter(name=n, path=_dir(tmp_path, n)) for n in ("a", "b")]
        placed.append(RuntimeAdapter(name="p", path=_dir(tmp_path, "p"), pinned=True))
        rt = _runtime(tmp_path, sim, adapters=placed)
        assert await _converge(sync, rt) == {"a": "loaded", "b": "failed", "p": "loaded"}
        assert set(_engine_holds(sim)) == {"own", "a", "p"}
    finally:
        await sync.close()


async def test_a_restarted_engine_gets_its_adapters_loaded_again(tmp_path: Path) -> None:
    first = _sim(tmp_path)
    sync = _sync(tmp_path)
    second: SimProcess | None = None
    try:
        sql = _dir(tmp_path, "sql")
        placed = [RuntimeAdapter(name="sql", path=sql)]
        assert await _converge(sync, _runtime(tmp_path, first, adapters=placed)) == {
            "sql": "loaded"
        }
        stop_sim(first)
        # The supervisor restarted the shard: a new process (generation, wrapper), on a port of
        # its own here. It holds none of its predecessor's runtime adapters.
        second = _sim(tmp_path)
        assert "sql" not in _engine_holds(second)
        rt = _runtime(tmp_path, second, generation=2, adapters=placed)
        with capture_logs() as logs:
            sync.follow({SHARD: rt})
            # Until the new process is read, nothing of it is claimed loaded.
            assert _states(sync) == {"sql": "loading"}
            await sync.idle()
        assert _states(sync) == {"sql": "loaded"}
        assert _engine_holds(second)["sql"] == sql
        assert [e["lost"] for e in logs if e["event"] == "adapters_engine_replaced"] == [["sql"]]
        assert sync.counts()[0].loads_ok == 2
    finally:
        await sync.close()
        stop_sim(first)
        if second is not None:
            stop_sim(second)


async def test_an_adopted_engine_is_reported_from_its_file_then_converged_from_its_list(
    tmp_path: Path, sim: SimProcess
) -> None:
    sql, chat, stray = _dir(tmp_path, "sql"), _dir(tmp_path, "chat"), _dir(tmp_path, "stray")
    # What an earlier agent left: two runtime adapters in the engine, one of them in its file.
    auth = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=sim.base_url, headers=auth) as c:
        for name, path in (("sql", sql), ("stray", stray)):
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert r.status_code == 200, r.text
    assert set(_engine_holds(sim)) == {"own", "sql", "stray"}
    rt = _runtime(tmp_path, sim, adapters=None)
    write_model(
        rt.dir / "adapters.json",
        ShardAdapters(
            generation=1, wrapper_pid=sim.proc.pid, wrapper_start_time=1, loaded={"sql": sql}
        ),
    )
    sync = _sync(tmp_path)
    try:
        # Before the first sync: no key, no placement. The file is reported, nothing called.
        assert await _converge(sync, rt) == {"sql": "loaded"}
        placed = [RuntimeAdapter(name="sql", path=sql), RuntimeAdapter(name="chat", path=chat)]
        with capture_logs() as logs:
            got = await _converge(sync, _runtime(tmp_path, sim, adapters=placed))
        assert got == {"sql": "loaded", "chat": "loaded"}
        assert _engine_holds(sim) == {"own": str(tmp_path), "sql": sql, "chat": chat}
        [listed] = [e for e in logs if e["event"] == "adapters_listed"]
        assert listed["held"] == ["sql", "stray"]
        # sql was not loaded again; stray, held but not placed, was unloaded.
        assert [e["adapter"] for e in logs if e["event"] == "adapter_loaded"] == ["chat"]
        assert [e["adapter"] for e in logs if e["event"] == "adapter_unloaded"] == ["stray"]
        assert json.loads((rt.dir / "adapters.json").read_text())["loaded"] == {
            "chat": chat,
            "sql": sql,
        }
    finally:
        await sync.close()


async def test_a_file_of_another_process_is_not_believed(tmp_path: Path, sim: SimProcess) -> None:
    rt = _runtime(tmp_path, sim, generation=3, adapters=None)
    write_model(
        rt.dir / "adapters.json",
        ShardAdapters(generation=2, wrapper_pid=sim.proc.pid, loaded={"sql": "/x"}),
    )
    sync = _sync(tmp_path)
    try:
        assert await _converge(sync, rt) == {}
    finally:
        await sync.close()
