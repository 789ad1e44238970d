"""CPU cores for CPU shards (issue 35): placement reserves a count, the agent picks which cores,
keeps them for the shard's life on the node, holds them again after an agent restart, and
shares rather than fails where the node has fewer than reserved; the engine's config.json is
checked before a CPU vLLM shard starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from llmgw.nodeagent.cores import CoreAllocator, CorePick
from llmgw.nodeagent.inventory.file import FileGpuSource, InventoryFile
from llmgw.nodeagent.launch import Launcher, PendingStart, StartFailed
from llmgw.nodeagent.prepare import PreparedShard, prepare, spec_without_secrets
from llmgw.nodeagent.records import ShardRecord, read_record, write_model
from llmgw.nodeagent.runtime import ShardRuntime
from llmgw.nodeagent.supervisor_config import SupervisorConfig
from llmgw.protocol import DesiredShard
from tests.nodeagent.agent_harness import sim_shard
from tests.nodeagent.test_prepare_policy import REGISTRY, facts
from tests.support.procs import agent_port_base

SEED = "3054198966"


def test_free_cores_first_lowest_first_then_the_least_shared() -> None:
    cores = CoreAllocator([5, 4, 3, 2, 1, 0])
    assert cores.allocate(2) == CorePick((0, 1))
    assert cores.allocate(3) == CorePick((2, 3, 4))
    cores.hold([9])  # a recorded core the agent may no longer run on: held, never given
    # One free core left for three threads: it, then the lowest of the least-held.
    assert cores.allocate(3) == CorePick((0, 1, 5), short=True)
    assert [cores.num_holders(c) for c in range(6)] == [2, 2, 1, 1, 1, 1]
    assert cores.allocate(1) == CorePick((2,), short=True)
    # A shared core stays taken until its last holder lets it go.
    cores.release([0, 1, 5])
    assert cores.num_holders(0) == 1 and cores.num_holders(5) == 0
    assert cores.allocate(1) == CorePick((5,))


def test_never_more_cores_than_the_node_has() -> None:
    cores = CoreAllocator([0, 1])
    assert cores.size_for(8) == 2 and cores.size_for(0) == 0
    # An inventory claiming 8 threads on 2 CPUs: both, and the pick says it came up short.
    assert cores.allocate(8) == CorePick((0, 1), short=True)
    assert cores.allocate(0) == CorePick(())
    cores.release([7])  # releasing what nobody holds changes nothing
    assert cores.num_holders(7) == 0


def vllm_cpu_shard(sid: str, threads: int = 2, **spec: Any) -> DesiredShard:
    return DesiredShard(
        shard_id=sid,
        replica_id=f"r-{sid}",
        fingerprint="fp-1",
        spec={
            "replica_id": f"r-{sid}",
            "shard_id": sid,
            "threads": threads,
            "profile": {
                "name": "tiny-cpu",
                "engine": "vllm",
                "gpu_class": "cpu",
                "model_path": "/models/tiny",
                "kv_events": True,
                "kv_hash": {"seed": SEED, "block_size": 32},
            },
            **spec,
        },
        engine_api_key="engine-key-0123456789",
        model="tiny",
    )


def _launcher(tmp: Path, cpus: tuple[int, ...]) -> Launcher:
    base = agent_port_base()
    return Launcher(
        SupervisorConfig(
            shards_root=tmp,
            wrapper_argv=(),
            port_range=(base, base + 47),
            proxy_port_range=(base + 48, base + 63),
            cpu_ids=cpus,
        ),
        gpu_source=FileGpuSource(InventoryFile()),
        wrapper_env={},
        boot_id="boot",
    )


def _prepared(d: DesiredShard) -> PreparedShard:
    p = prepare(d, REGISTRY, facts())
    assert p.launchable, p.error
    return p


def _record(pending: PendingStart) -> ShardRecord:
    return ShardRecord(
        shard_id=pending.prepared.shard_id,
        digest=pending.prepared.digest,
        spec=spec_without_secrets(pending.spec),
        http_port=pending.ports.http_port,
        kv_events_port=pending.ports.kv_events_port,
        kv_replay_port=pending.ports.kv_replay_port,
        proxy_port=pending.proxy_port,
    )


def _bind(pending: PendingStart) -> str:
    return pending.commands[-1].env["VLLM_CPU_OMP_THREADS_BIND"]


def test_a_cpu_shard_runs_on_cores_no_other_shard_holds_and_keeps_them(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, (0, 1, 2, 3, 4, 5, 6, 7))
    a = launcher.build(_prepared(vllm_cpu_shard("a", 3)), tmp_path / "a", None, facts=facts())
    b = launcher.build(_prepared(vllm_cpu_shard("b", 2)), tmp_path / "b", None, facts=facts())
    assert (a.spec.cpu_cores, b.spec.cpu_cores) == ((0, 1, 2), (3, 4))
    assert (_bind(a), _bind(b)) == ("0-2", "3-4")
    assert a.commands[-1].env["OMP_NUM_THREADS"] == "3"
    # The record carries them: a restart of the engine runs where it ran.
    rec_a = _record(a)
    assert rec_a.spec_view.cpu_cores == (0, 1, 2)
    prev = ShardRuntime(shard_id="a", dir=tmp_path / "a", record=rec_a, phase="exited")
    again = launcher.build(a.prepared, tmp_path / "a", prev, facts=facts())
    assert again.spec.cpu_cores == (0, 1, 2)
    # A new thread count (a profile edit) is a new pick, the old cores given back first.
    wider = _prepared(vllm_cpu_shard("a", 4))
    assert launcher.build(wider, tmp_path / "a", prev, facts=facts()).spec.cpu_cores == (
        0, 1, 2, 5,
    )  # fmt: skip
    # Forgetting a shard frees its cores.
    launcher.release(ShardRuntime(shard_id="b", dir=tmp_path / "b", record=_record(b),
                                  phase="exited"))  # fmt: skip
    c = launcher.build(_prepared(vllm_cpu_shard("c", 2)), tmp_path / "c", None, facts=facts())
    assert c.spec.cpu_cores == (3, 4)


def test_a_restarted_agent_holds_the_recorded_cores_of_the_engines_it_adopts(
    tmp_path: Path,
) -> None:
    first = _launcher(tmp_path, (0, 1, 2, 3))
    a = first.build(_prepared(vllm_cpu_shard("a", 2)), tmp_path / "a", None, facts=facts())
    write_model(tmp_path / "a" / "record.json", _record(a))
    # The next agent reads the record from disk (recover() -> hold) before anything starts.
    later = _launcher(tmp_path, (0, 1, 2, 3))
    later.hold(read_record(tmp_path / "a"))
    b = later.build(_prepared(vllm_cpu_shard("b", 2)), tmp_path / "b", None, facts=facts())
    assert (a.spec.cpu_cores, b.spec.cpu_cores) == ((0, 1), (2, 3))


def test_fewer_cores_than_reserved_are_shared_with_one_warning(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, (0, 1))
    with capture_logs() as logs:
        a = launcher.build(_prepared(vllm_cpu_shard("a", 4)), tmp_path / "a", None, facts=facts())
        b = launcher.build(_prepared(vllm_cpu_shard("b", 1)), tmp_path / "b", None, facts=facts())
    assert (a.spec.cpu_cores, b.spec.cpu_cores) == ((0, 1), (0,))
    assert a.commands[-1].env["OMP_NUM_THREADS"] == "4"  # the count placement reserved
    warnings = [e for e in logs if e["event"] == "cpu_cores_shared"]
    assert len(warnings) == 1 and warnings[0]["shard"] == "a" and warnings[0]["cpus"] == 2


def test_a_failed_build_gives_back_the_cores_it_took(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, (0, 1, 2, 3))
    d = vllm_cpu_shard("a", 2, secret_env={"HF_TOKEN": "env:CORES_TEST_SECRET"})
    p = prepare(d, REGISTRY, facts(environ={"CORES_TEST_SECRET": "s3cret"}))
    assert p.launchable, p.error
    # The variable is gone by the time the shard starts: the start fails before anything ran.
    with pytest.raises(StartFailed, match="CORES_TEST_SECRET"):
        launcher.build(p, tmp_path / "a", None, facts=facts(environ={}))
    assert [launcher.cores.num_holders(c) for c in range(4)] == [0, 0, 0, 0]
    # A restart with a new thread count that fails keeps the record's cores held, as the
    # record still names them.
    ok = launcher.build(_prepared(vllm_cpu_shard("a", 2)), tmp_path / "a", None, facts=facts())
    prev = ShardRuntime(shard_id="a", dir=tmp_path / "a", record=_record(ok), phase="exited")
    wider = prepare(
        vllm_cpu_shard("a", 3, secret_env={"HF_TOKEN": "env:CORES_TEST_SECRET"}),
        REGISTRY,
        facts(environ={"CORES_TEST_SECRET": "s3cret"}),
    )
    with pytest.raises(StartFailed):
        launcher.build(wider, tmp_path / "a", prev, facts=facts(environ={}))
    assert [launcher.cores.num_holders(c) for c in range(4)] == [1, 1, 0, 0]


def test_shards_of_engines_that_bind_no_cores_get_none(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, (0, 1))
    sim = prepare(sim_shard("s"), REGISTRY, facts())  # gpu_class cpu, threads 1
    assert launcher.build(sim, tmp_path / "s", None, facts=facts()).spec.cpu_cores == ()
    assert launcher.cores.num_holders(0) == 0


def _model_dir(tmp: Path, config: dict[str, Any] | str) -> str:
    d = tmp / "model"
    d.mkdir(exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (d / "config.json").write_text(text)
    return str(d)


def _with_model(d: DesiredShard, path: str) -> DesiredShard:
    spec = dict(d.spec)
    spec["profile"] = {**spec["profile"], "model_path": path}
    return d.model_copy(update={"spec": spec})


def test_a_model_whose_heads_cpu_attention_cannot_run_is_refused_before_it_starts(
    tmp_path: Path,
) -> None:
    small = _model_dir(tmp_path, {"hidden_size": 64, "num_attention_heads": 4})
    p = prepare(_with_model(vllm_cpu_shard("a"), small), REGISTRY, facts())
    assert not p.launchable
    assert "attention heads have 16 dimensions (its config.json)" in p.error
    assert "run this model on a GPU class or with llamacpp" in p.error
    fine = _model_dir(tmp_path, {"hidden_size": 128, "num_attention_heads": 2})
    assert prepare(_with_model(vllm_cpu_shard("a"), fine), REGISTRY, facts()).launchable
    # What cannot be read is left to the engine: a hub id, a broken file, no file.
    for path in ("org/tiny-model", _model_dir(tmp_path, "{not json"), str(tmp_path / "none")):
        assert prepare(_with_model(vllm_cpu_shard("a"), path), REGISTRY, facts()).launchable
