"""The operating-system side of running the server: users, environment, signals, pid files, ports.

Nothing here knows PostgreSQL's configuration or SQL; it is what _server.py, _initdb.py and
_roles.py need from the OS, kept apart so the lifecycle reads as steps. Linux first (/proc,
prctl); elsewhere it degrades to kill(pid, 0) and no parent-death signal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

from llmgw.errors import ConfigError
from llmgw.logs import get_logger

__all__ = [
    "HOST",
    "as_owner",
    "child_env",
    "chown",
    "die_with_parent",
    "free_port",
    "may_enter",
    "pid_in",
    "port_free",
    "process_name",
    "read_lines",
    "run_as",
    "server_owner",
    "shut_down",
    "start_lock",
    "tail",
    "write_private",
]

HOST = "127.0.0.1"

_log = get_logger("llmgw.embedded_postgres")


def shut_down(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    # SIGINT is PostgreSQL's "fast" shutdown: roll back sessions, checkpoint, exit. SIGQUIT
    # ("immediate") skips the checkpoint and costs a crash recovery next start, still safe.
    # SIGKILL goes to the whole group so no orphaned backend keeps the shared memory.
    for sig, how, wait_s in (
        (signal.SIGINT, "fast", timeout_s),
        (signal.SIGQUIT, "immediate", 5.0),
    ):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(wait_s)
            return how
        except subprocess.TimeoutExpired:
            _log.warning("postgres_stop_slow", pid=proc.pid, signal=sig.name)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return "killed"


def server_owner() -> tuple[int, int] | None:
    """(uid, gid) of `postgres` when we are root (PostgreSQL refuses to run as root), else None."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise ConfigError(
            "running as root, llmgw starts PostgreSQL as the `postgres` user (it refuses to run as "
            "root), but there is no such user: create it (`useradd --system postgres`, or install "
            "the postgresql package) or run llmgw as an ordinary user",
            field="user",
        ) from None
    return entry.pw_uid, entry.pw_gid


class _OwnerKwargs(TypedDict, total=False):
    user: int
    group: int
    extra_groups: list[int]


def as_owner(owner: tuple[int, int] | None) -> _OwnerKwargs:
    # extra_groups=[] drops root's supplementary groups, which the server must not keep.
    return {} if owner is None else {"user": owner[0], "group": owner[1], "extra_groups": []}


def run_as(
    args: list[str], owner: tuple[int, int] | None, *, cwd: Path
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=child_env(),
        check=False,
        timeout=300,
        **as_owner(owner),
    )


def child_env() -> dict[str, str]:
    # A minimal environment: the server must not inherit our secrets (admin tokens) nor stray
    # PG* variables, and LC_ALL=C keeps its log in the English our failure checks read.
    env = {"LC_ALL": "C", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for key in ("TZ", "LD_LIBRARY_PATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def die_with_parent() -> None:
    # Runs in the child after setuid (a uid change would clear it), before exec. The signal
    # fires when the thread that spawned the server exits: start throwaway servers from a
    # thread that lives as long as they should (pytest's main thread does).
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGINT))


@contextlib.contextmanager
def start_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created 0600) for the block; waits for a holder."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def may_enter(st: os.stat_result, owner: tuple[int, int]) -> bool:
    uid, gid = owner
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def chown(p: Path, owner: tuple[int, int] | None) -> None:
    if owner is not None:
        os.chown(p, *owner)


def write_private(p: Path, text: str, owner: tuple[int, int] | None) -> None:
    tmp = p.with_name(p.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    chown(tmp, owner)
    tmp.replace(p)


def read_lines(p: Path) -> list[str]:
    try:
        return p.read_text().splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return []


def pid_in(pidfile: Path) -> int | None:
    lines = read_lines(pidfile)
    try:
        return int(lines[0]) if lines else None
    except ValueError:
        return None


def process_name(pid: int) -> str | None:
    """The live process's name, "" if alive but unreadable, None if gone (or a zombie)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    if fields.get("State", "").startswith("Z"):
        return None
    return fields.get("Name", "").strip()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As PostgreSQL binds: with SO_REUSEADDR, so the TIME_WAIT connections a killed server
        # leaves behind do not make its own port look taken when it is restarted there.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])
