"""`llmgw shard-run`, the per-shard wrapper, run for real with small Python programs as commands.

What it must guarantee: every process of a stopped shard is gone (also a child that ignores
SIGTERM, also one that left the process group with setsid), its exit code survives in
exit.json, output goes to rotated files (no pipe to the agent), commands start in order and
a command waiting for the leader port waits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from llmgw.engines import Command, CommandFile
from llmgw.nodeagent import procs
from llmgw.nodeagent.exits import found_exited
from llmgw.nodeagent.inventory.file import FileGpuSource, InventoryFile
from llmgw.nodeagent.launch import Launcher
from llmgw.nodeagent.procs import MARKER_ENV, is_alive, kill_marked, marked_pids
from llmgw.nodeagent.records import ShardRecord, read_exit, read_procs, read_record, write_model
from llmgw.nodeagent.runtime import ShardRuntime
from llmgw.nodeagent.shardrun import EXIT_LAUNCH_FAILED, RotatingLog, ShardLaunch
from llmgw.nodeagent.supervisor_config import SupervisorConfig
from tests.support.procs import free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _py(name: str, code: str, **kw: object) -> Command:
    return Command(
        name=name,
        path=sys.executable,
        args=("-c", textwrap.dedent(code)),
        env={"PATH": os.environ.get("PATH", "")},
        **kw,  # type: ignore[arg-type]
    )


class Wrapper:
    def __init__(self, tmp: Path, commands: list[Command], **launch: object) -> None:
        self.shard_id = f"t-{uuid.uuid4().hex[:8]}"
        self.dir = tmp / self.shard_id
        self.dir.mkdir()
        self.launch = ShardLaunch(
            shard_id=self.shard_id,
            shard_dir=str(self.dir),
            commands=tuple(commands),
            grace_s=1.0,
            **launch,  # type: ignore[arg-type]
        )
        env = {"PATH": os.environ.get("PATH", ""), MARKER_ENV: self.shard_id}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "shard-run", "--shard-dir", str(self.dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=(self.dir / "wrapper.log").open("wb"),
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(self.launch.model_dump_json().encode())
        self.proc.stdin.close()

    def procs(self) -> list[int]:
        p = read_procs(self.dir)
        return [x.pid for x in p.procs] if p else []

    def wait_procs(self, n: int) -> list[int]:
        return wait_for(
            lambda: len(self.procs()) == n and self.procs(), timeout_s=20, what=f"{n} processes"
        )

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        kill_marked(self.shard_id)


def test_stop_kills_the_group_a_sigterm_ignorer_and_a_setsid_escapee(tmp_path: Path) -> None:
    ready = tmp_path / "escapee.pid"
    w = Wrapper(
        tmp_path,
        [
            # A sidecar that ignores SIGTERM.
            _py(
                "stubborn",
                """
                import signal, time
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                print("stubborn up", flush=True)
                time.sleep(600)
                """,
            ),
            # The engine, which starts a grandchild that leaves the process group.
            _py(
                "engine",
                f"""
                import os, subprocess, sys, time
                p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                     start_new_session=True)
                open({str(ready)!r}, "w").write(str(p.pid))
                print("engine up", flush=True)
                time.sleep(600)
                """,
            ),
        ],
    )
    try:
        pids = w.wait_procs(2)
        escapee = int(
            wait_for(lambda: ready.exists() and ready.read_text(), timeout_s=20, what="escapee")
        )
        assert os.getpgid(escapee) != os.getpgid(pids[0])  # it really left the group
        assert set(marked_pids(w.shard_id)) >= {*pids, escapee, w.proc.pid}
        t0 = time.monotonic()
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=20) == 0
        # The stubborn one needed the SIGKILL after the 1 s grace period.
        assert time.monotonic() - t0 >= 1.0
        assert marked_pids(w.shard_id) == []
        assert not any(is_alive(p) for p in (*pids, escapee))
        ex = read_exit(w.dir)
        assert ex is not None and ex.stopped and ex.exit_code == 0
        assert "stubborn up" in (w.dir / "logs" / "stubborn.log").read_text()
        assert "engine up" in (w.dir / "logs" / "engine.log").read_text()
    finally:
        w.cleanup()


def test_a_command_exit_ends_the_shard_with_its_code_and_stops_the_sidecars(
    tmp_path: Path,
) -> None:
    w = Wrapper(
        tmp_path,
        [
            _py("sidecar", "import time; time.sleep(600)"),
            _py(
                "engine",
                "import sys, time; print('boom', file=sys.stderr); time.sleep(0.5); sys.exit(7)",
            ),
        ],
    )
    try:
        assert w.proc.wait(timeout=20) == 7
        ex = read_exit(w.dir)
        assert ex is not None and (ex.exit_code, ex.command, ex.stopped) == (7, "engine", False)
        assert marked_pids(w.shard_id) == []
        assert "boom" in (w.dir / "logs" / "engine.log").read_text()
    finally:
        w.cleanup()


def test_files_are_written_private_before_the_command_runs(tmp_path: Path) -> None:
    w = Wrapper(
        tmp_path,
        [
            _py(
                "engine",
                "import os, sys; sys.exit(0 if open('cfg/key.yaml').read() == 'k: v' else 3)",
                files=(CommandFile(path="cfg/key.yaml", content="k: v", secret=True),),
            )
        ],
    )
    try:
        assert w.proc.wait(timeout=20) == 0
        assert ((w.dir / "run" / "cfg" / "key.yaml").stat().st_mode & 0o777) == 0o600
    finally:
        w.cleanup()


def test_wait_for_leader_port_holds_the_command_until_the_port_accepts(tmp_path: Path) -> None:
    port = free_port()
    marker = tmp_path / "started"
    w = Wrapper(
        tmp_path,
        [
            _py(
                "worker",
                f"import time; open({str(marker)!r}, 'w').write('x'); time.sleep(600)",
                wait_for_leader_port=True,
            )
        ],
        leader_addr="127.0.0.1",
        leader_port=port,
    )
    try:
        time.sleep(1.5)
        assert not marker.exists(), "started before the leader listened"
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()
            wait_for(marker.exists, timeout_s=20, what="the worker to start once the port accepts")
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=20) == 0
    finally:
        w.cleanup()


def test_a_rank_without_commands_holds_until_stopped(tmp_path: Path) -> None:
    w = Wrapper(tmp_path, [])
    try:
        # procs.json is written after the signal handlers are in place: a SIGTERM sent before
        # (the interpreter still starting, on a busy machine) would kill the wrapper outright.
        wait_for(lambda: read_procs(w.dir), timeout_s=20, what="procs.json")
        time.sleep(0.5)  # holding, not exiting: nothing to wait on but time
        assert w.proc.poll() is None
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=10) == 0
    finally:
        w.cleanup()


def test_a_missing_program_and_a_truncated_launch_fail_with_an_exit_file(tmp_path: Path) -> None:
    w = Wrapper(tmp_path, [Command(name="x", path="/nonexistent/engine-binary")])
    try:
        assert w.proc.wait(timeout=20) == EXIT_LAUNCH_FAILED
        ex = read_exit(w.dir)
        assert ex is not None and "/nonexistent/engine-binary" in ex.error
    finally:
        w.cleanup()
    d = tmp_path / "trunc"
    d.mkdir()
    p = subprocess.run(
        [sys.executable, "-m", "llmgw", "shard-run", "--shard-dir", str(d)],
        input=b'{"shard_id": "x", "shard_dir": "' + str(d).encode() + b'", "commands": [{"na',
        capture_output=True,
        timeout=30,
    )
    assert p.returncode == EXIT_LAUNCH_FAILED
    assert json.loads((d / "exit.json").read_text())["error"].startswith("launch on stdin")


def test_rotating_log_keeps_backups_and_starts_fresh_on_restart(tmp_path: Path) -> None:
    path = tmp_path / "e.log"
    log = RotatingLog(path, max_bytes=100, backups=2)
    for i in range(10):
        log.write(f"line {i:03d} ".encode() * 5)  # 45 bytes each
    log.close()
    assert path.stat().st_size <= 100
    assert (tmp_path / "e.log.1").exists() and (tmp_path / "e.log.2").exists()
    assert not (tmp_path / "e.log.3").exists()
    assert "line 009" in path.read_text()
    RotatingLog(path, max_bytes=100, backups=2).close()
    assert path.stat().st_size == 0
    assert "line 009" in (tmp_path / "e.log.1").read_text()


# --- how the next agent reads a shard's end back ------------------------------------------------


def _adopted(w: Wrapper) -> ShardRuntime:
    """The runtime an agent holds for the wrapper, with the record it would have written."""
    rec = ShardRecord(
        shard_id=w.shard_id,
        digest="d",
        spec={},
        boot_id=procs.boot_id(),
        wrapper_pid=w.proc.pid,
        wrapper_start_time=wait_for(
            lambda: procs.has_marker(w.proc.pid, w.shard_id) and procs.proc_start_time(w.proc.pid),
            timeout_s=10,
            what="the wrapper to exec",
        ),
        restarts=2,
    )
    write_model(w.dir / "record.json", rec)
    return ShardRuntime(shard_id=w.shard_id, dir=w.dir, record=rec, phase="live")


def _next_agent_reads(w: Wrapper) -> ShardRuntime:
    """What the agent that starts next makes of the shard: its record and how it ended."""
    rt = ShardRuntime(shard_id=w.shard_id, dir=w.dir, record=read_record(w.dir), phase="exited")
    found_exited(rt, now=100.0)
    return rt


async def test_a_stop_the_agent_asked_for_reads_back_as_that_stop_not_as_a_crash(
    tmp_path: Path,
) -> None:
    """`llmgw up`'s Ctrl-C: the agent stops its engines for the next agent to start again. The
    next one must report the stop that was asked for, not "stopped by a signal to its wrapper",
    and must not count a restart (the record keeps its count; launch.py adds none for it)."""
    w = Wrapper(tmp_path, [_py("engine", "import time; time.sleep(600)")])
    try:
        w.wait_procs(1)
        rt = _adopted(w)
        launcher = Launcher(
            SupervisorConfig(shards_root=tmp_path, wrapper_argv=(), stop_grace_s=1.0),
            gpu_source=FileGpuSource(InventoryFile()),
            wrapper_env={},
            boot_id=procs.boot_id(),
        )
        reason = "stopped: its agent exited (--stop-engines-on-exit)"
        await launcher.stop(rt, on_purpose=reason)
        assert w.proc.wait(timeout=10) == 0
        assert marked_pids(w.shard_id) == []
        after = _next_agent_reads(w)
        assert after.exit_reason == reason
        assert (after.record.stopped_reason, after.record.restarts) == (reason, 2)
        assert (after.restart_at, after.consecutive_failures) == (100.0, 0)
        assert after.tail == ""  # the log's end explains a crash; there was none
    finally:
        w.cleanup()


def test_a_crash_before_the_stop_reached_the_shard_stays_a_crash(tmp_path: Path) -> None:
    """A record that says a stop was asked for is believed only where the exit agrees: an
    engine that exited on its own (code 7) crashed, whatever the agent meant to do next."""
    w = Wrapper(tmp_path, [_py("engine", "import sys, time; time.sleep(0.5); sys.exit(7)")])
    try:
        rt = _adopted(w)
        write_model(w.dir / "record.json", rt.record.model_copy(update={"stopped_reason": "R"}))
        assert w.proc.wait(timeout=20) == 7
        after = _next_agent_reads(w)
        assert after.exit_reason == "command 'engine' exited with code 7"
        # Dropped in memory: the start that follows counts a restart (launch.py).
        assert after.record.stopped_reason == ""
    finally:
        w.cleanup()


def test_a_signal_nobody_recorded_still_reads_as_a_signal(tmp_path: Path) -> None:
    w = Wrapper(tmp_path, [_py("engine", "import time; time.sleep(600)")])
    try:
        w.wait_procs(1)
        _adopted(w)
        w.proc.send_signal(signal.SIGTERM)  # an operator's kill, not the agent's stop
        assert w.proc.wait(timeout=20) == 0
        after = _next_agent_reads(w)
        assert after.exit_reason == "stopped by a signal to its wrapper"
        assert after.record.stopped_reason == ""
    finally:
        w.cleanup()
