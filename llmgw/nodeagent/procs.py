"""Process identity on Linux: boot id, start times and the shard marker, read from /proc.

A pid alone proves nothing after an agent restart: pids are reused, and an
agent that adopted (or killed) a stranger that got an engine's old pid would
serve another program's answers or kill it. The proof is the triple (boot id,
pid, start time) plus the `LLMGW_SHARD_ID` marker every process of a shard
carries in its environment.

This module must NOT send signals except through `kill_marked`, which only
ever signals processes carrying the marker of the shard it is given.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

__all__ = [
    "MARKER_ENV",
    "boot_id",
    "has_marker",
    "is_alive",
    "kill_marked",
    "marked_pids",
    "proc_start_time",
    "same_process",
]

# In the environment of every process of a shard (wrapper, engine, its
# children). Stopping by marker finds the processes that left the shard's
# process group (setsid, daemonised helpers) and would keep GPUs and ports.
MARKER_ENV = "LLMGW_SHARD_ID"

_PROC = Path("/proc")


def boot_id() -> str:
    """This boot's id: start times are only comparable within one boot."""
    try:
        return (_PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), None when the pid is gone.

    The command name (field 2) may contain spaces and parentheses, so the
    fields are counted after its last ')'.
    """
    try:
        raw = (_PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2 :].split()
    # rest[0] is field 3 (state); a zombie has finished and is not alive.
    if len(rest) < 20 or rest[0] == b"Z":
        return None
    try:
        return int(rest[19])
    except ValueError:
        return None


def is_alive(pid: int) -> bool:
    return proc_start_time(pid) is not None


def _environ(pid: int) -> bytes:
    try:
        return (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return b""


def has_marker(pid: int, shard_id: str) -> bool:
    """Whether the process carries LLMGW_SHARD_ID=<shard_id> (exactly) in its environment."""
    want = f"{MARKER_ENV}={shard_id}".encode()
    return want in _environ(pid).split(b"\0")


def same_process(pid: int, start_time: int | None, shard_id: str) -> bool:
    """The process is the one recorded: alive, same start time, carrying the shard's marker."""
    if pid <= 0 or start_time is None:
        return False
    return proc_start_time(pid) == start_time and has_marker(pid, shard_id)


def marked_pids(shard_id: str, *, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Every live process carrying the shard's marker."""
    out = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in exclude or pid == os.getpid():
            continue
        if has_marker(pid, shard_id) and is_alive(pid):
            out.append(pid)
    return sorted(out)


def kill_marked(shard_id: str, sig: int = signal.SIGKILL) -> list[int]:
    """Signal every process carrying the shard's marker; returns the pids signalled."""
    pids = marked_pids(shard_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    return pids
