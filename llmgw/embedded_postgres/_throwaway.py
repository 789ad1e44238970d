"""Where throwaway data dirs live, and sweeping up the ones a killed run left behind.

A throwaway dir goes to /dev/shm when there is room (initdb and the server write ~40 MB; on a
tmpfs that takes a third of the time a virtual disk does: 0.55 s against 1.6 s for initdb here,
most of a throwaway server's start), else to the usual temp dir. It must never remove a dir whose
maker or server may still be alive, nor another user's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from llmgw.embedded_postgres._process import pid_in, process_name, write_private
from llmgw.logs import get_logger

__all__ = ["make_throwaway_dir", "throwaway_parent"]

_RAM_TMP = Path("/dev/shm")
_RAM_TMP_MIN_FREE_BYTES = 1 << 30
_PREFIX = "llmgw-pg-"
# The pid of the process that made a throwaway dir: once it is gone, so is every use of the dir.
_OWNER_FILE = "owner.pid"

_log = get_logger("llmgw.embedded_postgres")


def make_throwaway_dir() -> Path:
    parent = Path(throwaway_parent() or tempfile.gettempdir())
    _sweep_stale(parent)
    made = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=parent))
    write_private(made / _OWNER_FILE, f"{os.getpid()}\n", None)
    return made


def throwaway_parent() -> str | None:
    """Where throwaway data dirs go: /dev/shm when writable with room to spare, else None (the
    usual temp dir). A small /dev/shm (Docker's 64 MB default) is skipped: a cluster needs 40 MB
    before its first table."""
    try:
        st = os.statvfs(_RAM_TMP)
    except OSError:
        return None
    if (
        os.access(_RAM_TMP, os.W_OK | os.X_OK)
        and st.f_bavail * st.f_frsize >= _RAM_TMP_MIN_FREE_BYTES
    ):
        return str(_RAM_TMP)
    return None


def _sweep_stale(parent: Path) -> None:
    # A run killed with SIGKILL stops its server (parent-death signal) but cannot remove its dir,
    # and in /dev/shm every one left behind holds 40+ MB of RAM until reboot. Only our own dirs
    # whose maker and server are both dead go; a dir without the owner file is being created.
    for d in parent.glob(_PREFIX + "*"):
        try:
            if d.stat().st_uid != os.geteuid():
                continue
        except OSError:
            continue
        maker = pid_in(d / _OWNER_FILE)
        if maker is None or process_name(maker) is not None:
            continue
        server = pid_in(d / "postgres" / "postmaster.pid")
        if server is not None and process_name(server) is not None:
            continue
        shutil.rmtree(d, ignore_errors=True)
        _log.info("postgres_throwaway_swept", data_dir=str(d))
