"""A shard's processes as the supervisor sees them: whether its wrapper still runs, and killing
what outlived it.

Below both starting and stopping (launch.py) and reading ends (exits.py), which each ask these
two questions, so neither calls into the other. Proof of identity is procs.py's (boot id, start
time, the shard's marker); this module only applies it to a shard's runtime and record.
"""

from __future__ import annotations

from llmgw.logs import get_logger
from llmgw.nodeagent import procs
from llmgw.nodeagent.runtime import ShardRuntime

__all__ = ["kill_leftovers", "wrapper_running"]

# The supervisor's logger: these events were the supervisor's own before it was split up, and
# whoever reads the logs finds them where they were.
log = get_logger("llmgw.nodeagent.supervisor")


def wrapper_running(rt: ShardRuntime) -> bool:
    """Whether the shard's wrapper still runs: our child's exit status, else /proc's proof."""
    if rt.popen is not None:
        return rt.popen.poll() is None
    rec = rt.record
    return rec.wrapper_pid is not None and procs.same_process(
        rec.wrapper_pid, rec.wrapper_start_time, rt.shard_id
    )


def kill_leftovers(shard_id: str) -> None:
    """SIGKILL every process still marked with this shard (its wrapper is gone)."""
    killed = procs.kill_marked(shard_id)
    if killed:
        log.warning("shard_leftovers_killed", shard=shard_id, pids=killed)
