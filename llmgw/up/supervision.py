"""Keeping `llmgw up`'s processes alive: a child that died is restarted alone, with growing
pauses, and a Postgres that died is restarted on its own port, so every URL stays valid.

What it must not do: start a child for the first time or decide what runs (the launcher
does), or give up on a child that started well (only status 2, llmgw's "bad configuration",
while starting and before `up` is announced, is final: restarting cannot fix it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.embedded_postgres import EmbeddedPostgres
from llmgw.errors import EngineStartError
from llmgw.logs import get_logger
from llmgw.periodic import backoff_delay
from llmgw.up import children as procs
from llmgw.up.children import Child

__all__ = ["postgres_alive", "restart_dead"]

log = get_logger("llmgw.up")

# A child that keeps dying is restarted with growing pauses, not in a hot loop: 1 s after
# its first exit, doubling, at most 30 s.
_RESTART_BACKOFF_BASE_S = 1.0
_RESTART_BACKOFF_MAX_S = 30.0


def _backoff(failures: int) -> float:
    return backoff_delay(failures, _RESTART_BACKOFF_BASE_S, _RESTART_BACKOFF_MAX_S)


def restart_dead(
    children: dict[str, Child], data_dir: Path, say: Callable[[str], None], *, announced: bool
) -> None:
    """Schedule a restart for each child found dead, and start each whose pause is over."""
    now = time.monotonic()
    for child in children.values():
        p = child.popen
        if p is None or p.poll() is None:
            continue
        if child.restart_at is None:
            if not announced and p.returncode == 2 and now - child.started_at < 30:
                # Status 2 is llmgw's "bad configuration": restarting cannot fix it.
                raise EngineStartError(
                    f"the {child.name} exited with status 2 while starting; its log "
                    f"({child.log_path}):\n{child.log_tail()}"
                )
            # A child that stayed up a minute earns a fresh backoff.
            if now - child.started_at > 60:
                child.failures = 0
            pause = _backoff(child.failures)
            child.failures += 1
            child.restart_at = now + pause
            log.warning("child_exited", child=child.name, status=p.returncode, restart_in_s=pause)
            say(
                f"The {child.name} exited (status {p.returncode}); restarting it in "
                f"{pause:.0f}s (log: {child.log_path})"
            )
        elif now >= child.restart_at:
            child.start()
            procs.record_children(data_dir, list(children.values()))


def postgres_alive(pg: EmbeddedPostgres, stop: threading.Event) -> bool:
    """Restart a Postgres that died (a crash, the OOM killer, `kill -9`) on its port.

    The control plane stays up meanwhile: /readyz says 503 and its pool, which pings each
    connection before use, reconnects by itself once the server is back. Returns whether
    Postgres runs (False only when a stop was asked for while waiting to restart it).
    """
    status = pg.exited()
    if status is None:
        return True
    log.warning("postgres_exited", status=status, pid_file=str(pg.pgdata / "postmaster.pid"))
    failures = 0
    while not stop.is_set():
        pause = _backoff(failures)
        log.warning("postgres_restart_scheduled", attempt=failures + 1, restart_in_s=pause)
        if stop.wait(pause):
            return False
        try:
            pg.restart()
        except Exception as exc:  # any failure to start is retried, longer each time
            log.warning("postgres_restart_failed", error=str(exc).splitlines()[0])
            failures += 1
            continue
        log.info("postgres_restarted", pid=pg.pid, port=pg.port, attempts=failures + 1)
        return True
    return False
