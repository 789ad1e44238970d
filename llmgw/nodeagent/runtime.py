"""One shard as the supervisor tracks it in memory, and what it reports of it.

The record on disk (records.py) is what survives the agent; this is what
the agent learns while it runs: the wrapper's process handle, health, the
crash count behind the backoff, the last exit. `binding()` turns it into
the protocol's ShardBinding, the only view the control plane gets.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from llmgw.engines import Engine
from llmgw.nodeagent.diff import Phase, RunningView
from llmgw.nodeagent.prepare import PreparedShard
from llmgw.nodeagent.records import ShardExit, ShardRecord
from llmgw.protocol import MAX_LOG_TAIL_CHARS, MAX_REASON_CHARS, ObservedState, ShardBinding
from llmgw.protocol.sync import AdapterObserved

__all__ = ["Health", "ShardRuntime", "log_tail"]

Health = Literal["starting", "ready", "unhealthy"]


def log_tail(logs_dir: Path, command: str = "", max_chars: int = 4096) -> str:
    """The end of the log of `command` (or of the most recently written log)."""
    # The wrapper's own output sits beside the logs dir: it is what says why a
    # wrapper died before its commands ran.
    named = logs_dir.parent / "wrapper.log" if command == "wrapper" else logs_dir / f"{command}.log"
    candidates = [named] if command else []
    if not candidates or not candidates[0].exists():
        logs = (
            sorted(logs_dir.glob("*.log"), key=lambda p: p.stat().st_mtime)
            if logs_dir.is_dir()
            else []
        )
        candidates = logs[-1:]
    for path in candidates:
        try:
            with path.open("rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - max_chars * 2))
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        return text[-max_chars:]
    return ""


@dataclass
class ShardRuntime:
    shard_id: str
    dir: Path
    record: ShardRecord
    phase: Phase
    engine: Engine | None = None
    popen: subprocess.Popen[bytes] | None = None
    health: Health = "starting"
    was_ready: bool = False
    health_reason: str = ""
    # monotonic clock of the current process's start; None when adopted
    # (the record's wall-clock started_at says how long it has run).
    started_mono: float | None = None
    consecutive_failures: int = 0
    restart_at: float = 0.0
    last_exit: ShardExit | None = None
    exit_reason: str = ""
    tail: str = ""
    suspended: bool = False
    engine_pid: int | None = None
    engine_start_time: int | None = None
    # Where the wrapper serves the shard's front door, as its procs.json says; 0 while not
    # known, and for a shard served by none (another rank, or a wrapper too old to serve one).
    proxy_host: str = ""
    proxy_port: int = 0
    # The desired shard it runs for, when the control plane has said so.
    prepared: PreparedShard | None = None
    # Set while a stop is under way; what to do when it finishes.
    after_stop: Literal["forget", "restart"] = "forget"
    held_reason: str = ""
    # The CPU-fallback check's answer for the generation it ran on ("" = on its GPUs).
    cpu_checked_generation: int = -1
    cpu_fallback: str = ""
    notes: list[str] = field(default_factory=list)

    def replaced(self) -> None:
        """Stopped to be started again with a new spec: due at once, no crash counted."""
        self.popen = None
        self.phase = "exited"
        self.engine_pid = None
        self.health = "starting"
        self.was_ready = False
        self.restart_at = 0.0
        self.consecutive_failures = 0
        self.exit_reason = "replaced: its desired spec changed"
        self.last_exit = None
        # A replaced shard restarts at once: its digest no longer matches.
        self.record = self.record.model_copy(update={"digest": ""})

    def view(self) -> RunningView:
        return RunningView(
            shard_id=self.shard_id,
            digest=self.record.digest,
            phase=self.phase,
            restart_at=self.restart_at,
            suspended=self.suspended,
        )

    def observed_state(self, crash_loop_after: int) -> ObservedState:
        if self.phase == "stopping":
            return "draining"
        if self.phase == "exited":
            return "failed" if self.consecutive_failures >= crash_loop_after else "exited"
        return self.health

    def binding(
        self,
        *,
        crash_loop_after: int,
        boot_id: str,
        now: float,
        proxy_url: str = "",
        extra_reason: str = "",
        adapters: tuple[AdapterObserved, ...] = (),
    ) -> ShardBinding:
        state = self.observed_state(crash_loop_after)
        reasons = [r for r in (self.held_reason, extra_reason) if r]
        if self.suspended and self.phase == "live":
            reasons.insert(0, "suspended: GPU memory freed, the process kept")
        if state in ("exited", "failed"):
            wait = max(0.0, self.restart_at - now)
            if state == "failed":
                reasons.insert(
                    0,
                    f"crash loop: {self.consecutive_failures} failed starts in a row; "
                    f"{self.exit_reason}",
                )
            else:
                reasons.insert(0, self.exit_reason)
            if self.prepared is not None and self.prepared.launchable:
                reasons.append(f"restart in {wait:.1f}s")
        elif state == "unhealthy" and self.health_reason:
            reasons.insert(0, self.health_reason)
        reason = "; ".join(r for r in reasons if r)[:MAX_REASON_CHARS]
        rec = self.record
        exit_code = self.last_exit.exit_code if self.last_exit is not None else None
        return ShardBinding(
            shard_id=self.shard_id,
            observed_state=state,
            reason=reason,
            pid=self.engine_pid or rec.wrapper_pid if self.phase != "exited" else None,
            boot_id=boot_id if self.phase != "exited" else "",
            process_start_time=(
                self.engine_start_time if self.engine_pid else rec.wrapper_start_time
            )
            if self.phase != "exited"
            else None,
            http_port=rec.http_port,
            kv_events_port=rec.kv_events_port,
            kv_replay_port=rec.kv_replay_port,
            proxy_url=proxy_url if state == "ready" else "",
            fingerprint=rec.fingerprint,
            restarts=rec.restarts,
            exit_code=exit_code,
            started_at=rec.started_at or None,
            log_tail=self.tail[-MAX_LOG_TAIL_CHARS:] if state == "failed" else "",
            adapters=adapters,
        )
