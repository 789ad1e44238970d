"""`llmgw up`'s backstop: the engines an agent left running when it exited (dead, or hung past
its stop timeout) are killed by their marker, and each record notes that stop, so the next
agent starts them again without counting a crash."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from llmgw.nodeagent import procs
from llmgw.nodeagent.records import ShardRecord, read_record, write_model
from llmgw.up.children import stop_orphan_engines
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_engines_an_agent_left_are_killed_and_their_records_note_the_stop(tmp_path: Path) -> None:
    state_dir = tmp_path / "agent"
    left, ended = f"t-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}"
    for sid in (left, ended):
        d = state_dir / "shards" / sid
        write_model(d / "record.json", ShardRecord(shard_id=sid, digest="d", spec={}, restarts=1))
    # A start that died before its first write leaves a directory without a record.
    (state_dir / "shards" / "no-record").mkdir()
    engine = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={procs.MARKER_ENV: left},
    )
    try:
        wait_for(lambda: procs.has_marker(engine.pid, left), timeout_s=10, what="the engine")
        stop_orphan_engines(state_dir)
        assert engine.wait(timeout=10) != 0
        assert procs.marked_pids(left) == []
        rec = read_record(state_dir / "shards" / left)
        assert "llmgw up" in rec.stopped_reason and rec.restarts == 1
        # A shard with nothing left running had ended by itself: no stop to note.
        assert read_record(state_dir / "shards" / ended).stopped_reason == ""
    finally:
        engine.kill()
        engine.wait()
