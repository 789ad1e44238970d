"""Records and the state dir: atomic writes, corrupt files named, epochs that only grow,
process identity from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.nodeagent import procs
from llmgw.nodeagent.records import (
    RecordError,
    ShardRecord,
    atomic_write,
    mark_stopped,
    read_record,
    safe_shard_dirname,
    write_model,
)
from llmgw.nodeagent.state import AgentState, NodeIdentity, next_epoch
from tests.support.waiting import wait_for


def _record(shard_id: str) -> ShardRecord:
    return ShardRecord(shard_id=shard_id, digest="d", spec={"shard_id": shard_id}, http_port=20000)


def test_record_round_trip_and_private_mode(tmp_path: Path) -> None:
    d = tmp_path / "s1"
    write_model(d / "record.json", _record("s1"))
    assert read_record(d) == _record("s1")
    assert ((d / "record.json").stat().st_mode & 0o777) == 0o600
    assert [p.name for p in d.iterdir()] == ["record.json"]  # no temp file left


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"shard_id": "s1", "dig', "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"shard_id": "s1"}', "digest"),
        (b'{"shard_id": "other", "digest": "d", "spec": {}}', "names shard 'other'"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_corrupt_records_are_named(tmp_path: Path, content: bytes, needle: str) -> None:
    d = tmp_path / "s1"
    d.mkdir()
    (d / "record.json").write_bytes(content)
    with pytest.raises(RecordError, match=needle):
        read_record(d)


def test_records_from_a_newer_agent_are_still_read(tmp_path: Path) -> None:
    d = tmp_path / "s1"
    d.mkdir()
    (d / "record.json").write_text('{"shard_id": "s1", "digest": "d", "spec": {}, "future": 1}')
    assert read_record(d).digest == "d"


def test_a_stop_asked_for_is_noted_in_the_record_and_nothing_else_changes(tmp_path: Path) -> None:
    d = tmp_path / "s1"
    before = _record("s1").model_copy(update={"restarts": 3})
    write_model(d / "record.json", before)
    assert read_record(d).stopped_reason == ""  # a record from before the field: no stop noted
    noted = mark_stopped(d, "stopped when `llmgw up` stopped")
    assert noted == read_record(d)
    assert noted.model_dump() == {**before.model_dump(), "stopped_reason": noted.stopped_reason}
    assert noted.stopped_reason == "stopped when `llmgw up` stopped"
    # Nothing to note it in: no record (a start that died before writing one), or a bad one.
    assert mark_stopped(tmp_path / "none", "x") is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "record.json").write_text("{")
    assert mark_stopped(tmp_path / "bad", "x") is None
    assert (tmp_path / "bad" / "record.json").read_text() == "{"


def test_shard_ids_cannot_escape_the_state_dir() -> None:
    assert safe_shard_dirname("shard-1.a_b") == "shard-1.a_b"
    for bad in ("../x", "a/b", ".hidden", "", "x" * 200):
        with pytest.raises(RecordError):
            safe_shard_dirname(bad)


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    path = tmp_path / "f"
    atomic_write(path, b"old")

    with pytest.raises(TypeError):
        atomic_write(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_epochs_only_grow(tmp_path: Path) -> None:
    st = AgentState(tmp_path / "state")
    st.ensure()
    e1, e2 = st.new_epoch(), st.new_epoch()
    assert e2 > e1 >= int(time.time()) - 5
    # A clock that went back still gives a larger epoch.
    assert next_epoch(10**10, 5.0) == 10**10 + 1
    assert (st.root.stat().st_mode & 0o777) == 0o700


def test_identity_is_private_and_never_in_repr(tmp_path: Path) -> None:
    st = AgentState(tmp_path / "state")
    st.ensure()
    ident = NodeIdentity(node_id="n", node_credential="cred-abc-123", cluster_id="c")
    st.save_identity(ident)
    assert ((st.root / "identity.json").stat().st_mode & 0o777) == 0o600
    assert st.load_identity() == ident
    assert "cred-abc-123" not in repr(ident)


@pytest.mark.e2e
def test_process_identity_from_proc() -> None:
    assert procs.boot_id()
    me = procs.proc_start_time(os.getpid())
    assert me is not None and me == procs.proc_start_time(os.getpid())
    env = {**os.environ, procs.MARKER_ENV: "ident-test"}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        start = procs.proc_start_time(p.pid)
        # Until exec, the child's /proc environ is still the parent's.
        wait_for(lambda: procs.has_marker(p.pid, "ident-test"), timeout_s=10, what="exec")
        assert procs.same_process(p.pid, start, "ident-test")
        assert not procs.same_process(p.pid, (start or 0) + 1, "ident-test")  # a reused pid
        assert not procs.same_process(p.pid, start, "ident-tes")  # marker compared exactly
        assert procs.marked_pids("ident-test") == [p.pid]
    finally:
        p.kill()
        p.wait()
    assert not procs.is_alive(p.pid)
    assert procs.marked_pids("ident-test") == []
