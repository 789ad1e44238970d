"""The processes of `llmgw up`: one supervised child (its log, its stop), the data dir's
lock, the record of children that lets a run clean up after a killed one, and the backstop
that kills engines an agent left behind.

What it must not do: signal a process it cannot prove is its own: a pid is always checked
with its start time (children.json) or the shard marker (engines), never trusted alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.embedded_postgres import die_with_parent
from llmgw.errors import ConfigError, ConflictError
from llmgw.logs import get_logger, rotate_file
from llmgw.up.bootstrap import write_private

__all__ = [
    "Child",
    "data_dir_lock",
    "nvml_gpu_count",
    "port_free",
    "record_children",
    "stop_leftovers",
    "stop_orphan_engines",
]

log = get_logger("llmgw.up")

CHILDREN_JSON = "children.json"
# A child rotates its own log while it runs (log.file, which start() sets; its log.max_bytes
# and log.backups, 64 MiB and 3 by default). What it wrote before its logging was set up, or
# a crash at import, lands in the same file: moved aside here at the same size, so a child
# that crash-loops before it can rotate cannot fill the disk either.
_LOG_ROTATE_BYTES = 64 << 20
_LOG_BACKUPS = 3
# A leftover agent stops its engines before it exits: each gets its SIGTERM grace.
_LEFTOVER_STOP_TIMEOUT_S = 60.0


def port_free(host: str, port: int, *, field: str = "--host") -> bool:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"{field} {host!r} does not resolve ({exc})", field=field) from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError:
            return False
    return True


@contextlib.contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the data dir for the life of one `llmgw up`.

    Checked first, before ports or Postgres: a second `llmgw up` on the same data
    dir is told exactly that, with the holder's pid, instead of tripping over a
    port or a server the first one owns. The kernel drops the lock when the
    process dies, so a crash never leaves a stale lock behind.
    """
    path = data_dir / "up.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConflictError(
                f"data dir {data_dir} is in use by another `llmgw up` (pid {holder}); stop it, "
                "or pass another --data-dir",
                field="--data-dir",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@dataclass
class Child:
    """One supervised child process: its command, log file and restart state."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    stop_timeout_s: float
    popen: subprocess.Popen[bytes] | None = None
    failures: int = 0
    started_at: float = 0.0
    restart_at: float | None = None
    ever_ready: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        if self.log_path.exists() and self.log_path.stat().st_size >= _LOG_ROTATE_BYTES:
            rotate_file(self.log_path, _LOG_BACKUPS)
        # The child writes its log to this file itself and rotates it by size (llmgw.logs
        # log_to_file): a long-lived `up` must not fill the disk. Before, the file only moved
        # aside at a restart, and an agent flooded with errors wrote 77 MB in 40 s.
        env = {**self.env, "LLMGW_LOG__FILE": str(self.log_path)}
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as out:
            # Own session: a Ctrl-C in the terminal reaches `up` alone, which stops the children
            # in order instead of all dying at once mid-write. Should `up` be killed outright,
            # the parent-death signal stops them instead of leaving them orphaned.
            self.popen = subprocess.Popen(
                self.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.started_at = time.monotonic()
        self.restart_at = None
        log.info("child_started", child=self.name, pid=self.popen.pid, log=str(self.log_path))

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("child_kill", child=self.name, pid=p.pid)
            p.kill()
            p.wait()
        log.info("child_stopped", child=self.name, status=p.returncode)


def record_children(data_dir: Path, children: list[Child]) -> None:
    """children.json: which processes this run started, so that the next run can stop what
    a killed `up` left (pid plus start time: a reused pid is never mistaken for ours)."""
    from llmgw.nodeagent.procs import proc_start_time

    records = []
    for child in children:
        if child.popen is not None:
            pid = child.popen.pid
            records.append({"name": child.name, "pid": pid, "start_time": proc_start_time(pid)})
    write_private(data_dir / CHILDREN_JSON, json.dumps(records) + "\n")


def stop_leftovers(data_dir: Path, say: Callable[[str], None]) -> None:
    """Stop the children a killed `up` left running (their parent-death signal normally
    stops them; this covers one still stopping, or one that ignored it). The agent among
    them stops its engines; whatever engines remain, the new agent adopts."""
    from llmgw.nodeagent.procs import proc_start_time

    path = data_dir / CHILDREN_JSON
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    left = [
        r
        for r in records
        if isinstance(r, dict)
        and r.get("start_time") is not None
        and proc_start_time(int(r["pid"])) == r["start_time"]
    ]
    # Agents first (they stop engines), then the control plane: the order of a Ctrl-C.
    left.sort(key=lambda r: not str(r.get("name", "")).startswith("agent"))
    for r in left:
        pid = int(r["pid"])
        log.warning("leftover_child_stopping", child=r.get("name"), pid=pid)
        say(f"Stopping the {r.get('name')} (pid {pid}) a previous `llmgw up` left ...")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _LEFTOVER_STOP_TIMEOUT_S
        while time.monotonic() < deadline and proc_start_time(pid) == r["start_time"]:
            time.sleep(0.05)
        if proc_start_time(pid) == r["start_time"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)


def stop_orphan_engines(state_dir: Path) -> None:
    """Kill every process of a shard the agent did not stop (it was dead, or hung past its
    timeout): a shard the agent stopped has no process left, so whatever carries a marker was
    left running. Each record killed notes the stop, so the next agent starts it again without
    counting a crash (records.ShardRecord.stopped_reason)."""
    from llmgw.nodeagent.procs import kill_marked
    from llmgw.nodeagent.records import RecordError, list_shard_dirs, mark_stopped, read_record

    for d in list_shard_dirs(state_dir / "shards"):
        try:
            shard_id = read_record(d).shard_id
        except (FileNotFoundError, RecordError):
            continue
        killed = kill_marked(shard_id)
        if killed:
            log.warning("engine_killed_after_agent", shard=shard_id, pids=killed)
            mark_stopped(d, "stopped when `llmgw up` stopped (its agent had not stopped it)")
        deadline = time.monotonic() + 10
        while kill_marked(shard_id) and time.monotonic() < deadline:
            time.sleep(0.05)


def nvml_gpu_count() -> int:
    """GPUs NVML reports on this machine; 0 without a driver (the usual laptop or CI)."""
    if not Path("/dev/nvidiactl").exists():
        return 0
    try:
        from llmgw.nodeagent.inventory import NvmlGpuSource

        source = NvmlGpuSource()
        try:
            return len(source.gpus())
        finally:
            source.close()
    except Exception as exc:  # no library, no driver, a driver mismatch: simulated GPUs only
        log.info("nvml_unavailable", error=str(exc).splitlines()[0] if str(exc) else "")
        return 0
