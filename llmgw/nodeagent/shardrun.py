"""`llmgw shard-run`: the wrapper that owns one shard's processes (docs/architecture.md §4).

The agent starts one wrapper per shard in a new session and hands it the
launch (commands with their complete environments, which hold the engine's
API key) on stdin, then closes the pipe: nothing connects the shard to the
agent afterwards, so an agent that crashes, upgrades or is `kill -9`ed
leaves every engine running, and the wrapper still records how its shard
ends. The wrapper:

- starts the commands in order (sidecars first), holding a command that asks
  for it until the leader's port accepts a connection; a rank with no command
  of its own holds its GPUs by staying alive until stopped;
- puts every command in one process group of their own (not the wrapper's:
  SIGKILL to a group that held the wrapper would kill it before it wrote the
  exit file) and marks every process with LLMGW_SHARD_ID;
- copies each command's output into rotated log files (no pipe to the agent;
  the pipe to the wrapper is the shard's own: a wrapper killed with SIGKILL
  ends its shard, whose remains the agent kills by marker and restarts);
- when any command exits, stops the rest and writes exit.json with that
  command's exit code: a sidecar that died leaves the shard broken;
- on SIGTERM/SIGINT: SIGTERM to the group, SIGKILL after the grace period,
  then SIGKILL to anything still carrying the marker (processes that left the
  group with setsid), then writes exit.json (stopped) and exits;
- for a leader that serves HTTP, serves the shard's front door (frontdoor.py:
  the engine's authenticating proxy on the management address) from before
  its first command starts until its commands have stopped, and records where
  it listens in procs.json. Bound first, so that a port taken since the agent
  allocated it fails the launch at once, not after an engine spent minutes
  loading; while the engine loads, the proxy answers 502 upstream-unavailable,
  and no gateway routes to a shard not yet reported ready. Stopped last, so the
  answers an engine finishes during its grace period still reach their clients.

This module must NOT import the agent's shell, nor talk to the network beyond
the leader-port probe and the front door.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict, Field

from llmgw.engines import Command
from llmgw.nodeagent.frontdoor import FrontDoor, FrontDoorLaunch
from llmgw.nodeagent.procs import MARKER_ENV, kill_marked, proc_start_time
from llmgw.nodeagent.records import ShardExit, ShardProc, ShardProcs, write_model

__all__ = ["EXIT_LAUNCH_FAILED", "RotatingLog", "ShardLaunch", "run_shard"]

# Exit status of a wrapper that could not start its shard at all.
EXIT_LAUNCH_FAILED = 97
_POLL_S = 0.25
_MAX_LAUNCH_BYTES = 16 << 20


class ShardLaunch(BaseModel):
    """What the agent hands a wrapper on stdin."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_id: str
    shard_dir: str
    commands: tuple[Command, ...]
    # The distributed-init endpoint a command with wait_for_leader_port waits on.
    leader_addr: str = ""
    leader_port: int = 0
    leader_wait_s: float = Field(default=600.0, gt=0)
    # SIGTERM to SIGKILL, as the engine needs to finish requests and free GPUs.
    grace_s: float = Field(default=30.0, ge=0)
    log_max_bytes: int = Field(default=16 << 20, gt=0)
    log_backups: int = Field(default=3, ge=0)
    # The shard's front door; None for a rank that serves no HTTP (and from an older agent).
    proxy: FrontDoorLaunch | None = None


class RotatingLog:
    """A log file rotated by size: name.log, name.log.1 ... name.log.<backups>."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int) -> None:
        self._path = path
        self._max = max_bytes
        self._backups = backups
        # A restart starts a fresh file: the previous run's output stays in .1,
        # where the crash that ended it is easy to find.
        if path.exists() and path.stat().st_size > 0:
            self._rotate()
        self._f: IO[bytes] = path.open("ab")
        self._size = 0

    def _rotate(self) -> None:
        for i in range(self._backups, 0, -1):
            src = self._path if i == 1 else self._path.with_name(f"{self._path.name}.{i - 1}")
            if src.exists():
                # The oldest backup is overwritten by os.replace.
                os.replace(src, self._path.with_name(f"{self._path.name}.{i}"))
        if self._backups == 0:
            self._path.unlink(missing_ok=True)

    def write(self, data: bytes) -> None:
        if self._size + len(data) > self._max and self._size > 0:
            self._f.close()
            self._rotate()
            self._f = self._path.open("ab")
            self._size = 0
        self._f.write(data)
        self._f.flush()
        self._size += len(data)

    def close(self) -> None:
        self._f.close()


class _Wrapper:
    def __init__(self, launch: ShardLaunch) -> None:
        self.launch = launch
        self.dir = Path(launch.shard_dir)
        self.logs_dir = self.dir / "logs"
        self.run_dir = self.dir / "run"
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.pgid: int | None = None
        self.stop_requested = False
        self.sel = selectors.DefaultSelector()
        self.logs: dict[int, RotatingLog] = {}
        self.front_door: FrontDoor | None = None

    # --- signals --------------------------------------------------------------

    def _on_stop(self, signum: int, _frame: object) -> None:
        self.stop_requested = True

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        # The wrapper is in its own session; a hangup is never a stop.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    # --- starting ---------------------------------------------------------------

    def _write_files(self, command: Command) -> None:
        for f in command.files:
            path = Path(f.path)
            if not path.is_absolute():
                path = self.run_dir / path
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, f.mode)
            try:
                os.fchmod(fd, f.mode)
                os.write(fd, f.content.encode())
            finally:
                os.close(fd)

    def _wait_leader(self) -> bool:
        """True once the leader port accepts a connection; False on stop or deadline."""
        deadline = time.monotonic() + self.launch.leader_wait_s
        addr, port = self.launch.leader_addr, self.launch.leader_port
        while not self.stop_requested:
            try:
                with socket.create_connection((addr, port), timeout=1.0):
                    return True
            except OSError:
                pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return False

    def start(self, command: Command) -> None:
        self._write_files(command)
        env = dict(command.env)
        env[MARKER_ENV] = self.launch.shard_id
        log = RotatingLog(
            self.logs_dir / f"{_safe_name(command.name)}.log",
            max_bytes=self.launch.log_max_bytes,
            backups=self.launch.log_backups,
        )
        proc = subprocess.Popen(
            list(command.argv),
            env=env,
            cwd=self.run_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # The first command founds the shard's group, the rest join it.
            process_group=0 if self.pgid is None else self.pgid,
        )
        if self.pgid is None:
            self.pgid = proc.pid
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        self.sel.register(proc.stdout, selectors.EVENT_READ, proc.pid)
        self.logs[proc.pid] = log
        self.procs.append((command.name, proc))
        self._write_procs()

    def _write_procs(self) -> None:
        write_model(
            self.dir / "procs.json",
            ShardProcs(
                wrapper_pid=os.getpid(),
                pgid=self.pgid,
                proxy_host=self.front_door.launch.host if self.front_door is not None else "",
                proxy_port=self.front_door.port if self.front_door is not None else 0,
                procs=[
                    ShardProc(name=name, pid=p.pid, start_time=proc_start_time(p.pid))
                    for name, p in self.procs
                ],
            ),
        )

    # --- running ----------------------------------------------------------------

    def pump(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            # os.read on the raw descriptor: a non-blocking buffered read answers
            # None for "nothing yet", which would read as end of file.
            try:
                data = os.read(key.fd, 65536)
            except (BlockingIOError, InterruptedError):
                continue
            if data:
                self.logs[key.data].write(data)
            else:
                self.sel.unregister(key.fileobj)

    def first_exit(self) -> tuple[str, int] | None:
        for name, p in self.procs:
            code = p.poll()
            if code is not None:
                return name, code
        return None

    # --- stopping ---------------------------------------------------------------

    def stop_all(self) -> None:
        """SIGTERM the group, SIGKILL after the grace period, then every marked process."""
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGTERM)
            deadline = time.monotonic() + self.launch.grace_s
            while time.monotonic() < deadline and any(p.poll() is None for _, p in self.procs):
                self.pump(0.05)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        for _, p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        # Anything that left the group (setsid) but still carries the marker.
        deadline = time.monotonic() + 5
        while kill_marked(self.launch.shard_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.drain()

    def drain(self) -> None:
        """Copy what the exited commands left in their pipes, until every pipe is at EOF."""
        deadline = time.monotonic() + 2
        while self.sel.get_map() and time.monotonic() < deadline:
            self.pump(0.05)

    def start_front_door(self) -> None:
        if self.launch.proxy is not None:
            door = FrontDoor(self.launch.shard_id, self.launch.proxy)
            door.start()
            self.front_door = door

    def finish(self, result: ShardExit) -> None:
        # Closed before the exit is written: an agent that reads the exit and restarts the
        # shard at once finds the port free again.
        if self.front_door is not None:
            self.front_door.stop()
        write_model(self.dir / "exit.json", result)
        for log in self.logs.values():
            log.close()


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "command"


def run_shard(launch: ShardLaunch) -> int:
    """Run the shard until one of its commands exits or a stop is requested; the exit status."""
    w = _Wrapper(launch)
    w.install_signals()
    w.logs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    w.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for stale in ("exit.json", "procs.json"):
        (w.dir / stale).unlink(missing_ok=True)
    try:
        w.start_front_door()
    except OSError as e:
        proxy = launch.proxy
        assert proxy is not None
        w.finish(
            ShardExit(
                exit_code=EXIT_LAUNCH_FAILED,
                finished_at=time.time(),
                error=f"front door cannot listen on {proxy.host}:{proxy.port}: "
                f"{e.strerror or e}; the agent allocates another port on the next start",
            )
        )
        return EXIT_LAUNCH_FAILED
    w._write_procs()
    try:
        for command in launch.commands:
            if w.stop_requested:
                break
            if command.wait_for_leader_port and not w._wait_leader():
                if w.stop_requested:
                    break
                w.stop_all()
                w.finish(
                    ShardExit(
                        exit_code=EXIT_LAUNCH_FAILED,
                        command=command.name,
                        finished_at=time.time(),
                        error=f"leader {launch.leader_addr}:{launch.leader_port} did not accept "
                        f"a connection within {launch.leader_wait_s:g}s",
                    )
                )
                return EXIT_LAUNCH_FAILED
            w.start(command)
    except OSError as e:
        w.stop_all()
        w.finish(
            ShardExit(
                exit_code=EXIT_LAUNCH_FAILED,
                finished_at=time.time(),
                error=f"cannot start {e.filename or 'command'}: {e.strerror}",
            )
        )
        return EXIT_LAUNCH_FAILED
    while not w.stop_requested:
        ended = w.first_exit()
        if ended is not None:
            name, code = ended
            w.stop_all()
            w.finish(ShardExit(exit_code=code, command=name, finished_at=time.time()))
            # A negative code is a signal; a shell would say 128+N.
            return code if code >= 0 else 128 - code
        w.pump(_POLL_S)
    w.stop_all()
    w.finish(ShardExit(exit_code=0, stopped=True, finished_at=time.time()))
    return 0


def main_from_stdin(shard_dir: str) -> int:
    """Read the launch from stdin (closed by the agent after writing) and run it."""
    raw = sys.stdin.buffer.read(_MAX_LAUNCH_BYTES + 1)
    error = ""
    launch: ShardLaunch | None = None
    if len(raw) > _MAX_LAUNCH_BYTES:
        error = f"launch is larger than {_MAX_LAUNCH_BYTES} bytes"
    else:
        try:
            launch = ShardLaunch.model_validate_json(raw)
        except ValueError as e:
            # Never echo the launch: its environments hold the API key.
            error = f"launch on stdin is not valid ({type(e).__name__}; truncated?)"
    if launch is None or Path(launch.shard_dir).resolve() != Path(shard_dir).resolve():
        error = error or "launch names another shard dir than --shard-dir"
        write_model(
            Path(shard_dir) / "exit.json",
            ShardExit(exit_code=EXIT_LAUNCH_FAILED, finished_at=time.time(), error=error),
        )
        print(f"llmgw shard-run: {error}", file=sys.stderr)
        return EXIT_LAUNCH_FAILED
    with contextlib.suppress(OSError):
        os.close(0)
    return run_shard(launch)
