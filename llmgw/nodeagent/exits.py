"""A wrapper's end as the supervisor learns of it, on each pass and after an agent start.

What a shard that ended leaves behind is read back (its exit file, else the wrapper's own
exit status), described for the control plane, and its log's tail kept; its processes that
outlived the wrapper are killed (they would hold its port and GPUs). A failure counts towards
the crash loop, and the next start is put off by an exponential backoff; a stop that was asked
for (the record's ``stopped_reason``: the agent exiting, or `llmgw up` after it) is no failure,
and is reported as what it was. While a wrapper runs, a pass only learns its engine's pid
and where its front door listens (procs.json, written by the wrapper).

This module must NOT start anything, nor decide whether a shard is restarted (diff.py): it
only says when it may be.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterable

from llmgw.logs import get_logger
from llmgw.nodeagent import procs
from llmgw.nodeagent.records import ShardExit, read_exit, read_procs
from llmgw.nodeagent.runtime import ShardRuntime, log_tail
from llmgw.nodeagent.shardprocs import kill_leftovers, wrapper_running
from llmgw.nodeagent.supervisor_config import SupervisorConfig
from llmgw.periodic import backoff_delay

__all__ = ["found_exited", "observe_exits", "refresh_engine_pid"]

# The supervisor's logger: these events were the supervisor's own before it was split up, and
# whoever reads the logs finds them where they were.
log = get_logger("llmgw.nodeagent.supervisor")


def observe_exits(runtimes: Iterable[ShardRuntime], now: float, cfg: SupervisorConfig) -> None:
    """Mark every running shard whose wrapper is gone as exited; learn the others' engine pid."""
    for rt in runtimes:
        if rt.phase not in ("live", "unadopted"):
            continue
        if wrapper_running(rt):
            if rt.engine_pid is None:
                refresh_engine_pid(rt)
            continue
        _on_exit(rt, now, cfg)


def found_exited(rt: ShardRuntime, now: float) -> None:
    """A shard whose wrapper was gone when the agent started: due for a restart at once (a
    start, if what ended it was a stop its record says was asked for)."""
    kill_leftovers(rt.shard_id)
    rt.last_exit = read_exit(rt.dir)
    _read_back(rt, found=True)
    rt.restart_at = now
    log.info(
        "shard_found_stopped" if rt.record.stopped_reason else "shard_found_exited",
        shard=rt.shard_id,
        reason=rt.exit_reason,
    )


def refresh_engine_pid(rt: ShardRuntime) -> None:
    """The engine's pid, once the wrapper has recorded it and it is still that process, and
    where the wrapper serves the shard's front door (recorded before its first command)."""
    p = read_procs(rt.dir)
    if p is not None and p.proxy_port:
        rt.proxy_host, rt.proxy_port = p.proxy_host, p.proxy_port
    if p is not None and p.procs:
        last = p.procs[-1]
        if procs.same_process(last.pid, last.start_time, rt.shard_id):
            rt.engine_pid = last.pid
            rt.engine_start_time = last.start_time


def _on_exit(rt: ShardRuntime, now: float, cfg: SupervisorConfig) -> None:
    if rt.popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rt.popen.wait(timeout=1)
    # The wrapper may have died with the engine still running (kill -9 of
    # the wrapper): nothing would stop that engine, which holds the port.
    kill_leftovers(rt.shard_id)
    rt.last_exit = read_exit(rt.dir)
    if rt.last_exit is None and rt.popen is not None and rt.popen.returncode is not None:
        rt.last_exit = ShardExit(
            exit_code=rt.popen.returncode,
            command="wrapper",
            error="the wrapper ended without an exit file (see wrapper.log)",
        )
    rt.popen = None
    rt.phase = "exited"
    rt.health = "starting"
    rt.was_ready = False
    rt.engine_pid = None
    rt.proxy_host, rt.proxy_port = "", 0
    _read_back(rt, found=False)
    if rt.record.stopped_reason:
        # The stop an earlier agent asked for, finished under this one (that agent was killed
        # while its engines stopped): no failure to count, nothing to wait for.
        rt.restart_at = now
        log.info("shard_stopped_on_purpose", shard=rt.shard_id, reason=rt.exit_reason)
        return
    uptime = (
        now - rt.started_mono
        if rt.started_mono is not None
        else time.time() - (rt.record.started_at or time.time())
    )
    # A shard that ran for a while and then crashed starts a new count: a
    # crash a day is not a crash loop.
    rt.consecutive_failures = 1 if uptime >= cfg.stable_after_s else rt.consecutive_failures + 1
    backoff = backoff_delay(
        rt.consecutive_failures - 1, cfg.restart_backoff_min_s, cfg.restart_backoff_max_s
    )
    rt.restart_at = now + backoff
    event = (
        "shard_crash_looping" if rt.consecutive_failures >= cfg.crash_loop_after else "shard_exited"
    )
    log.warning(
        event,
        shard=rt.shard_id,
        exit_code=rt.last_exit.exit_code if rt.last_exit else None,
        failures=rt.consecutive_failures,
        restart_in_s=round(backoff, 2),
    )


def _read_back(rt: ShardRuntime, *, found: bool) -> None:
    """Why the shard ended (from ``rt.last_exit`` and the record) and the end of the log that
    says more.

    A record noting a stop asked for (``stopped_reason``) is believed only when the exit agrees:
    the wrapper says it was stopped, or, for a shard ``found`` ended at the agent's start, left
    nothing (an agent whose stop timed out, or `llmgw up` after it, killed the whole shard). A
    command that exited on its own first is a crash whatever was asked afterwards, and so is a
    wrapper killed while this agent watched (nobody who asked for a stop is left to kill it);
    the reason is then dropped from the record in memory, and the next start counts a restart."""
    ex = rt.last_exit
    stopped_reason = rt.record.stopped_reason
    if stopped_reason and not (ex.stopped if ex is not None else found):
        stopped_reason = ""
        rt.record = rt.record.model_copy(update={"stopped_reason": ""})
    rt.exit_reason = stopped_reason or _describe(ex)
    rt.tail = "" if stopped_reason else log_tail(rt.dir / "logs", ex.command if ex else "")


def _describe(ex: ShardExit | None) -> str:
    if ex is None:
        return "the shard's wrapper is gone and left no exit code (killed, or the node rebooted)"
    if ex.error:
        return f"exit code {ex.exit_code}: {ex.error}"
    if ex.stopped:
        return "stopped by a signal to its wrapper"
    return f"command {ex.command!r} exited with code {ex.exit_code}"
