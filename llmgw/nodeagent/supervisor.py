"""The supervisor's shell: wrappers started, stopped, adopted and health-checked for real.

Each pass (`tick`) observes (which wrappers still run, how each engine's
health endpoint answers), asks the pure core (`diff.compute_plan`) what to
do, and does it. Stops run as background tasks (a grace period can be
minutes), so one slow engine never holds up the others.

The agent is never what keeps an engine alive: wrappers run in their own
sessions, get the launch on a pipe that is closed once written, and write
their output to files. An agent that exits (or is killed) leaves every
engine running; the next agent finds them through their records and adopts
those it can prove are the same processes (records.py, procs.py).

Before the control plane has said what it wants (the first sync after a
start, or while it is unreachable after a start) nothing is started,
stopped or adopted: the agent only watches and reports (fail static).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import httpx

from llmgw.engines import EngineRegistry
from llmgw.errors import SpecError
from llmgw.logs import get_logger
from llmgw.nodeagent import procs
from llmgw.nodeagent.adapters import AdapterFetchError, fetch_adapter, is_url
from llmgw.nodeagent.diff import Action, DesiredView, Plan, compute_plan
from llmgw.nodeagent.inventory import GpuSource
from llmgw.nodeagent.ports import PortAllocator, PortsExhausted
from llmgw.nodeagent.prepare import (
    LaunchPorts,
    NodeFacts,
    PreparedShard,
    build_launch,
    prepare,
    spec_without_secrets,
)
from llmgw.nodeagent.records import (
    RecordError,
    ShardRecord,
    list_shard_dirs,
    read_exit,
    read_procs,
    read_record,
    safe_shard_dirname,
    write_model,
)
from llmgw.nodeagent.runtime import ShardRuntime, log_tail
from llmgw.nodeagent.shardrun import ShardLaunch
from llmgw.protocol import DesiredShard, ShardBinding

__all__ = ["ShardHooks", "Supervisor", "SupervisorConfig"]

log = get_logger("llmgw.nodeagent.supervisor")


class ShardHooks(Protocol):
    """What else the agent runs per shard (the KV relay): told before an engine starts,
    when one is adopted, and when a shard is gone. Called from a worker thread."""

    def before_start(self, record: ShardRecord) -> None: ...

    def adopted(self, record: ShardRecord) -> None: ...

    def gone(self, shard_id: str) -> None: ...


class _NoHooks:
    def before_start(self, record: ShardRecord) -> None:
        return None

    def adopted(self, record: ShardRecord) -> None:
        return None

    def gone(self, shard_id: str) -> None:
        return None


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    shards_root: Path
    # How to start a wrapper: [python, -m, llmgw, shard-run]; --shard-dir is appended.
    wrapper_argv: tuple[str, ...]
    port_range: tuple[int, int] = (20000, 29999)
    stop_grace_s: float = 30.0
    start_timeout_s: float = 900.0
    restart_backoff_min_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    crash_loop_after: int = 3
    stable_after_s: float = 60.0
    leader_wait_s: float = 600.0
    log_max_bytes: int = 16 << 20
    log_backups: int = 3
    health_timeout_s: float = 2.0
    # How long a stopped shard's GPUs may take to show free of its processes.
    gpu_release_s: float = 30.0
    # Where adapters fetched from http(s) sources are stored (adapters.py).
    adapter_root: Path | None = None
    adapter_max_bytes: int = 2 << 30
    adapter_allow_loopback: bool = False
    # After a start that failed before its wrapper ran (a download, a secret
    # file, no free port), the next attempt waits this long.
    start_retry_s: float = 30.0


class Supervisor:
    def __init__(
        self,
        config: SupervisorConfig,
        registry: EngineRegistry,
        facts: Callable[[], NodeFacts],
        gpu_source: GpuSource,
        *,
        wrapper_env: Mapping[str, str],
        hooks: ShardHooks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hooks: ShardHooks = hooks or _NoHooks()
        self.cfg = config
        self.registry = registry
        self._facts = facts
        self._gpus = gpu_source
        self._wrapper_env = dict(wrapper_env)
        self._clock = clock
        self.runtimes: dict[str, ShardRuntime] = {}
        self.ports = PortAllocator(*config.port_range)
        self.boot_id = procs.boot_id()
        # Desired shards as last prepared; None until the control plane answered.
        self.desired: dict[str, PreparedShard] | None = None
        self.confirmed_drain = False
        # Shards reported without a runtime: unreadable records, refused specs.
        self.notes: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._client = httpx.AsyncClient(timeout=config.health_timeout_s, trust_env=False)
        self._held_logged: tuple[str, ...] = ()
        # Shards whose start failed before a wrapper ran: when to try again.
        self._retry_at: dict[str, float] = {}
        # Shards whose record was unreadable: their processes cannot be proven
        # ours, so none is adopted; once the control plane has spoken they are
        # killed by marker (not desired) or replaced by a fresh start (desired).
        self._quarantined: set[str] = set()
        self.counters: dict[str, int] = {"starts": 0, "restarts": 0, "stops": 0, "adopted": 0}

    # --- recovery after an agent start ------------------------------------------

    def recover(self) -> None:
        """Load every record; classify each shard as adoptable, exited, or unreadable."""
        self.cfg.shards_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        now = self._clock()
        for d in list_shard_dirs(self.cfg.shards_root):
            try:
                rec = read_record(d)
            except FileNotFoundError:
                # A directory without a record: a start that died before its first write.
                self._kill_leftovers(d.name)
                shutil.rmtree(d, ignore_errors=True)
                continue
            except RecordError as e:
                self._quarantine(d, str(e))
                continue
            self.ports.hold((rec.http_port, rec.kv_events_port, rec.kv_replay_port))
            engine = None
            with contextlib.suppress(SpecError):
                engine = self.registry.get(rec.engine) if rec.engine else None
            alive = (
                rec.boot_id == self.boot_id
                and rec.wrapper_pid is not None
                and procs.same_process(rec.wrapper_pid, rec.wrapper_start_time, rec.shard_id)
            )
            rt = ShardRuntime(
                shard_id=rec.shard_id,
                dir=d,
                record=rec,
                phase="unadopted" if alive else "exited",
                engine=engine,
            )
            if alive:
                self._refresh_engine_pid(rt)
                log.info(
                    "shard_found_running",
                    shard=rec.shard_id,
                    pid=rec.wrapper_pid,
                    engine_pid=rt.engine_pid,
                )
            else:
                self._kill_leftovers(rec.shard_id)
                rt.last_exit = read_exit(d)
                rt.exit_reason = self._describe_exit(rt)
                rt.tail = log_tail(d / "logs", rt.last_exit.command if rt.last_exit else "")
                rt.restart_at = now
                log.info("shard_found_exited", shard=rec.shard_id, reason=rt.exit_reason)
            self.runtimes[rec.shard_id] = rt

    def _quarantine(self, d: Path, why: str) -> None:
        shard_id = d.name
        log.error("shard_record_unreadable", shard=shard_id, error=why)
        self.notes[shard_id] = f"state record unreadable, shard skipped: {why}"
        self._quarantined.add(shard_id)
        # Keep the bad file for whoever debugs it, out of the way of a fresh start.
        with contextlib.suppress(OSError):
            os.replace(d / "record.json", d.with_name(f".{shard_id}.corrupt-{int(time.time())}"))
        shutil.rmtree(d, ignore_errors=True)

    def _kill_leftovers(self, shard_id: str) -> None:
        """SIGKILL every process still marked with this shard (its wrapper is gone)."""
        killed = procs.kill_marked(shard_id)
        if killed:
            log.warning("shard_leftovers_killed", shard=shard_id, pids=killed)

    # --- desired set -------------------------------------------------------------

    def set_desired(self, shards: Sequence[DesiredShard], *, confirmed_drain: bool) -> None:
        facts = self._facts()
        prepared: dict[str, PreparedShard] = {}
        old = self.desired or {}
        for d in shards:
            prev = old.get(d.shard_id)
            p = prev if prev is not None and prev.desired == d else prepare(d, self.registry, facts)
            prepared[d.shard_id] = p
            if p.error and (prev is None or prev.error != p.error):
                log.warning("shard_spec_refused", shard=d.shard_id, reason=p.error)
        self.desired = prepared
        self.confirmed_drain = confirmed_drain
        # What was said about shards no longer desired is no longer news.
        for sid in list(self.notes):
            if sid not in prepared and sid not in self._quarantined and sid not in self.runtimes:
                del self.notes[sid]
                self._retry_at.pop(sid, None)
        for sid, rt in self.runtimes.items():
            rt.prepared = prepared.get(sid)

    def _desired_views(self) -> dict[str, DesiredView]:
        assert self.desired is not None
        return {
            sid: DesiredView(
                shard_id=sid,
                digest=p.digest,
                state=p.desired.desired_state,
                launchable=p.launchable,
                suspendable=p.suspendable,
            )
            for sid, p in self.desired.items()
        }

    # --- the pass -----------------------------------------------------------------

    async def tick(self) -> Plan | None:
        """Observe, plan, act, probe health. Returns the plan (None before the first sync)."""
        now = self._clock()
        self._observe_exits(now)
        plan: Plan | None = None
        if self.desired is not None:
            for sid in sorted(self._quarantined):
                p = self.desired.get(sid)
                if p is None or p.desired.desired_state == "stopped":
                    self._kill_leftovers(sid)
                    self.notes.pop(sid, None)
                    self._quarantined.discard(sid)
            plan = compute_plan(
                self._desired_views(),
                {sid: rt.view() for sid, rt in self.runtimes.items()},
                now=now,
                confirmed_drain=self.confirmed_drain,
            )
            await self._apply(plan, now)
        await self._probe_health(now)
        return plan

    def _observe_exits(self, now: float) -> None:
        for rt in self.runtimes.values():
            if rt.phase not in ("live", "unadopted"):
                continue
            if rt.popen is not None:
                alive = rt.popen.poll() is None
            else:
                rec = rt.record
                alive = rec.wrapper_pid is not None and procs.same_process(
                    rec.wrapper_pid, rec.wrapper_start_time, rt.shard_id
                )
            if alive:
                if rt.engine_pid is None:
                    self._refresh_engine_pid(rt)
                continue
            self._on_exit(rt, now)

    def _on_exit(self, rt: ShardRuntime, now: float) -> None:
        if rt.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rt.popen.wait(timeout=1)
        # The wrapper may have died with the engine still running (kill -9 of
        # the wrapper): nothing would stop that engine, which holds the port.
        self._kill_leftovers(rt.shard_id)
        rt.last_exit = read_exit(rt.dir)
        if rt.last_exit is None and rt.popen is not None and rt.popen.returncode is not None:
            code = rt.popen.returncode
            from llmgw.nodeagent.records import ShardExit

            rt.last_exit = ShardExit(
                exit_code=code,
                command="wrapper",
                error="the wrapper ended without an exit file (see wrapper.log)",
            )
        rt.popen = None
        uptime = (
            now - rt.started_mono
            if rt.started_mono is not None
            else time.time() - (rt.record.started_at or time.time())
        )
        # A shard that ran for a while and then crashed starts a new count: a
        # crash a day is not a crash loop.
        rt.consecutive_failures = (
            1 if uptime >= self.cfg.stable_after_s else rt.consecutive_failures + 1
        )
        backoff = min(
            self.cfg.restart_backoff_max_s,
            self.cfg.restart_backoff_min_s * 2 ** (rt.consecutive_failures - 1),
        )
        rt.restart_at = now + backoff
        rt.phase = "exited"
        rt.health = "starting"
        rt.was_ready = False
        rt.engine_pid = None
        rt.exit_reason = self._describe_exit(rt)
        rt.tail = log_tail(rt.dir / "logs", rt.last_exit.command if rt.last_exit else "")
        event = (
            "shard_crash_looping"
            if rt.consecutive_failures >= self.cfg.crash_loop_after
            else "shard_exited"
        )
        log.warning(
            event,
            shard=rt.shard_id,
            exit_code=rt.last_exit.exit_code if rt.last_exit else None,
            failures=rt.consecutive_failures,
            restart_in_s=round(backoff, 2),
        )

    def _describe_exit(self, rt: ShardRuntime) -> str:
        ex = rt.last_exit
        if ex is None:
            return (
                "the shard's wrapper is gone and left no exit code (killed, or the node rebooted)"
            )
        if ex.error:
            return f"exit code {ex.exit_code}: {ex.error}"
        if ex.stopped:
            return "stopped by a signal to its wrapper"
        return f"command {ex.command!r} exited with code {ex.exit_code}"

    def _refresh_engine_pid(self, rt: ShardRuntime) -> None:
        p = read_procs(rt.dir)
        if p is not None and p.procs:
            last = p.procs[-1]
            if procs.same_process(last.pid, last.start_time, rt.shard_id):
                rt.engine_pid = last.pid
                rt.engine_start_time = last.start_time

    # --- acting ---------------------------------------------------------------

    async def _apply(self, plan: Plan, now: float) -> None:
        held = plan.held_stops
        if held != self._held_logged:
            if held:
                log.warning(
                    "shard_stops_held",
                    shards=list(held),
                    num_live=sum(
                        1 for r in self.runtimes.values() if r.phase in ("live", "unadopted")
                    ),
                    reason="more than half of the node's shards without a confirmed drain",
                )
            self._held_logged = held
        for rt in self.runtimes.values():
            rt.held_reason = (
                "stop held: the control plane asked to stop more than half of this node's "
                "shards without confirming a drain"
                if rt.shard_id in held
                else ""
            )
        # Stops first: they free ports and GPUs the starts may need.
        for a in sorted(plan.actions, key=lambda a: a.kind not in ("stop", "replace")):
            try:
                await self._act(a, now)
            except Exception:
                log.exception("shard_action_failed", shard=a.shard_id, action=a.kind)

    async def _act(self, a: Action, now: float) -> None:
        rt = self.runtimes.get(a.shard_id)
        if a.kind == "start":
            await self._start(a.shard_id, now)
        elif a.kind == "adopt" and rt is not None:
            rt.phase = "live"
            self.counters["adopted"] += 1
            await self._hook(self.hooks.adopted, rt.record)
            log.info("shard_adopted", shard=rt.shard_id, pid=rt.engine_pid or rt.record.wrapper_pid)
        elif a.kind == "replace" and rt is not None:
            log.info("shard_replacing", shard=rt.shard_id, reason=a.reason)
            self._begin_stop(rt, then="restart")
        elif a.kind == "stop" and rt is not None:
            log.info("shard_stopping", shard=rt.shard_id, reason=a.reason)
            self._begin_stop(rt, then="forget")
        elif a.kind == "forget" and rt is not None:
            self._forget(rt)
        elif a.kind in ("suspend", "resume") and rt is not None:
            await self._control(rt, a.kind)

    def _prepared(self, shard_id: str) -> PreparedShard | None:
        return (self.desired or {}).get(shard_id)

    def _ports_for(self, p: PreparedShard, prev: ShardRecord | None) -> LaunchPorts:
        # The engine binds http and replay itself: kept when still free, renewed when another
        # process took them. The KV events port is the agent's own SUB: always kept, so an
        # engine's PUB meets the mirror it had.
        http = (
            self.ports.renew(prev.http_port) if prev and prev.http_port else self.ports.allocate()
        )
        kv = rp = 0
        if p.needs_kv_ports:
            kv = prev.kv_events_port if prev and prev.kv_events_port else self.ports.allocate()
            rp = (
                self.ports.renew(prev.kv_replay_port)
                if prev and prev.kv_replay_port
                else self.ports.allocate()
            )
        return LaunchPorts(http, kv, rp)

    async def _start(self, shard_id: str, now: float) -> None:
        p = self._prepared(shard_id)
        if p is None or not p.launchable or p.engine is None:
            return
        prev_rt = self.runtimes.get(shard_id)
        prev = prev_rt.record if prev_rt is not None else None
        if self._retry_at.get(shard_id, 0.0) > now:
            return
        try:
            d = self.cfg.shards_root / safe_shard_dirname(shard_id)
        except RecordError as e:
            self._start_failed(shard_id, str(e), now)
            return
        if p.spec is not None and any(is_url(a.path) for a in p.spec.profile.adapters):
            try:
                p = await self._localize_adapters(p)
            except AdapterFetchError as e:
                self._start_failed(shard_id, str(e), now)
                return
        if prev_rt is None:
            # Nothing of an earlier life (an unreadable record) may hold its ports or GPUs.
            self._kill_leftovers(shard_id)
            self._quarantined.discard(shard_id)
        try:
            ports = self._ports_for(p, prev)
        except PortsExhausted as e:
            self._start_failed(shard_id, str(e), now)
            return
        facts = self._facts()
        try:
            spec, commands = build_launch(p, facts, ports, runtime_dir=str(d / "run"))
        except SpecError as e:
            # Ports not yet in a record go back to the pool: a start that keeps
            # failing must not drain the range.
            kept = {prev.http_port, prev.kv_events_port, prev.kv_replay_port} if prev else set()
            self.ports.release(
                x
                for x in (ports.http_port, ports.kv_events_port, ports.kv_replay_port)
                if x not in kept
            )
            self._start_failed(shard_id, e.message, now)
            return
        self.notes.pop(shard_id, None)
        self._retry_at.pop(shard_id, None)
        engine = p.engine
        assert engine is not None  # launchable implies an engine
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in ("exit.json", "procs.json"):
            (d / stale).unlink(missing_ok=True)
        restarted = prev_rt is not None and prev is not None and prev.digest == p.digest
        rec = ShardRecord(
            shard_id=shard_id,
            replica_id=p.desired.replica_id,
            fingerprint=p.desired.fingerprint,
            digest=p.digest,
            spec=spec_without_secrets(spec),
            engine=engine.name,
            model=p.desired.model,
            boot_id=self.boot_id,
            http_port=ports.http_port,
            kv_events_port=ports.kv_events_port,
            kv_replay_port=ports.kv_replay_port,
            started_at=time.time(),
            engine_path=commands[-1].path if commands else "",
            visible_devices=commands[-1].env.get("CUDA_VISIBLE_DEVICES", "") if commands else "",
            restarts=(prev.restarts + 1) if restarted and prev is not None else 0,
            generation=(prev.generation + 1) if prev is not None else 1,
        )
        # Written before the wrapper exists: an agent killed in between
        # leaves a record without a pid, and the next one kills the orphan by
        # its marker instead of losing track of it.
        write_model(d / "record.json", rec)
        # The KV listener binds before the engine's PUB connects: frames sent
        # to a port nobody polls are lost.
        await self._hook(self.hooks.before_start, rec)
        launch = ShardLaunch(
            shard_id=shard_id,
            shard_dir=str(d),
            commands=tuple(commands),
            leader_addr=spec.leader_addr,
            leader_port=spec.leader_port,
            leader_wait_s=self.cfg.leader_wait_s,
            grace_s=self.cfg.stop_grace_s,
            log_max_bytes=self.cfg.log_max_bytes,
            log_backups=self.cfg.log_backups,
        )
        env = dict(self._wrapper_env)
        env[procs.MARKER_ENV] = shard_id
        popen = await asyncio.to_thread(
            _spawn, [*self.cfg.wrapper_argv, "--shard-dir", str(d)], env, d
        )
        await asyncio.to_thread(_feed, popen, launch.model_dump_json().encode())
        rec = rec.model_copy(
            update={
                "wrapper_pid": popen.pid,
                "wrapper_start_time": procs.proc_start_time(popen.pid),
            }
        )
        write_model(d / "record.json", rec)
        rt = ShardRuntime(
            shard_id=shard_id,
            dir=d,
            record=rec,
            phase="live",
            engine=p.engine,
            popen=popen,
            started_mono=now,
            prepared=p,
            consecutive_failures=prev_rt.consecutive_failures if restarted and prev_rt else 0,
        )
        self.runtimes[shard_id] = rt
        self.counters["restarts" if restarted else "starts"] += 1
        log.info(
            "shard_started",
            shard=shard_id,
            wrapper_pid=popen.pid,
            http_port=ports.http_port,
            generation=rec.generation,
            restarts=rec.restarts,
        )

    def _start_failed(self, shard_id: str, why: str, now: float) -> None:
        """Report a start that could not happen; retry later, log once per distinct reason."""
        if self.notes.get(shard_id) != why:
            log.error("shard_start_failed", shard=shard_id, error=why)
        self.notes[shard_id] = why
        self._retry_at[shard_id] = now + self.cfg.start_retry_s

    async def _localize_adapters(self, p: PreparedShard) -> PreparedShard:
        """The prepared shard with every http(s) adapter replaced by its local copy."""
        assert p.spec is not None
        root = self.cfg.adapter_root or self.cfg.shards_root.parent / "adapters"
        adapters = []
        for a in p.spec.profile.adapters:
            if is_url(a.path):
                try:
                    local = await fetch_adapter(
                        a.path,
                        root,
                        max_bytes=self.cfg.adapter_max_bytes,
                        allow_loopback=self.cfg.adapter_allow_loopback,
                    )
                except httpx.HTTPError as e:
                    raise AdapterFetchError(
                        f"adapter {a.name!r}: {type(e).__name__}: {e}"
                    ) from None
                a = a.model_copy(update={"path": str(local)})
            adapters.append(a)
        profile = p.spec.profile.model_copy(update={"adapters": tuple(adapters)})
        return replace(p, spec=p.spec.model_copy(update={"profile": profile}))

    def _begin_stop(self, rt: ShardRuntime, *, then: str) -> None:
        rt.phase = "stopping"
        rt.after_stop = "restart" if then == "restart" else "forget"
        task = asyncio.create_task(self._stop(rt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop(self, rt: ShardRuntime) -> None:
        rec = rt.record
        pid = rec.wrapper_pid
        ours = rt.popen is not None
        alive = (
            (rt.popen.poll() is None)
            if rt.popen is not None
            else (pid is not None and procs.same_process(pid, rec.wrapper_start_time, rt.shard_id))
        )
        if alive and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            # The wrapper itself escalates to SIGKILL after the grace period.
            deadline = time.monotonic() + self.cfg.stop_grace_s + 10
            while time.monotonic() < deadline:
                if ours and rt.popen is not None:
                    if rt.popen.poll() is not None:
                        break
                elif not procs.same_process(pid, rec.wrapper_start_time, rt.shard_id):
                    break
                # Polling /proc: a process that is not our child signals nothing.
                await asyncio.sleep(0.05)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while procs.kill_marked(rt.shard_id) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await self._wait_gpus_free(rt)
        if rt.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rt.popen.wait(timeout=5)
        self.counters["stops"] += 1
        log.info("shard_stopped", shard=rt.shard_id, then=rt.after_stop)
        if rt.after_stop == "forget":
            self._forget(rt)
        else:
            rt.popen = None
            rt.phase = "exited"
            rt.engine_pid = None
            rt.health = "starting"
            rt.was_ready = False
            rt.restart_at = 0.0
            rt.consecutive_failures = 0
            rt.exit_reason = "replaced: its desired spec changed"
            rt.last_exit = None
            # A replaced shard restarts at once: its digest no longer matches.
            rt.record = rt.record.model_copy(update={"digest": ""})

    async def _wait_gpus_free(self, rt: ShardRuntime) -> None:
        """Where NVML exists, the shard's GPUs must show none of its processes."""
        indices = list(rt.record.spec.get("gpu_indices") or [])
        if not indices:
            return
        known = {p for p in (rt.engine_pid, rt.record.wrapper_pid) if p}
        deadline = time.monotonic() + self.cfg.gpu_release_s
        while time.monotonic() < deadline:
            holders = self._gpus.pids_on(indices)
            if not holders & known and not any(procs.has_marker(h, rt.shard_id) for h in holders):
                return
            await asyncio.sleep(0.2)
        log.error("shard_gpus_not_released", shard=rt.shard_id, gpus=indices)

    async def _hook(self, fn: Callable[[ShardRecord], None], rec: ShardRecord) -> None:
        try:
            await asyncio.to_thread(fn, rec)
        except Exception:
            log.exception("shard_hook_failed", shard=rec.shard_id, hook=fn.__name__)

    def _forget(self, rt: ShardRuntime) -> None:
        try:
            self.hooks.gone(rt.shard_id)
        except Exception:
            log.exception("shard_hook_failed", shard=rt.shard_id, hook="gone")
        self.runtimes.pop(rt.shard_id, None)
        self.ports.release(
            (rt.record.http_port, rt.record.kv_events_port, rt.record.kv_replay_port)
        )
        shutil.rmtree(rt.dir, ignore_errors=True)
        log.info("shard_forgotten", shard=rt.shard_id)

    async def _control(self, rt: ShardRuntime, what: str) -> None:
        """Suspend (free the GPUs, keep the process) or resume an engine that supports it.

        Megatron's coordinator, which the simulator follows, only suspends a
        paused engine and resumes to paused: pause then suspend, resume then
        unpause. A step already done answers 409, which is not a failure.
        """
        host = str(rt.record.spec.get("bind_addr") or "127.0.0.1")
        base = f"http://{host}:{rt.record.http_port}"
        steps = ("pause", "suspend") if what == "suspend" else ("resume", "unpause")
        for step in steps:
            try:
                r = await self._client.post(f"{base}/{step}")
            except httpx.HTTPError as e:
                log.warning("shard_control_failed", shard=rt.shard_id, action=step, error=str(e))
                return
            if r.status_code >= 300 and r.status_code != 409:
                log.warning(
                    "shard_control_failed", shard=rt.shard_id, action=step, status=r.status_code
                )
                return
        rt.suspended = what == "suspend"
        log.info("shard_" + ("suspended" if rt.suspended else "resumed"), shard=rt.shard_id)

    # --- health -----------------------------------------------------------------

    async def _probe_health(self, now: float) -> None:
        live = [rt for rt in self.runtimes.values() if rt.phase in ("live", "unadopted")]
        if live:
            await asyncio.gather(*(self._probe(rt, now) for rt in live))

    async def _probe(self, rt: ShardRuntime, now: float) -> None:
        engine = rt.engine
        spec = rt.record.spec
        leader = int(spec.get("rank", 0) or 0) == 0
        if engine is None or not leader or rt.record.http_port <= 0:
            # A rank that serves no HTTP is ready while its processes run.
            rt.health = "ready"
            return
        host = str(spec.get("bind_addr") or "127.0.0.1")
        url = f"http://{host}:{rt.record.http_port}{engine.health_path}"
        status: int | None
        try:
            status = (await self._client.get(url)).status_code
        except httpx.HTTPError:
            status = None
        state = engine.readiness.classify(status, was_ready=rt.was_ready)
        if state == "ready" and not rt.was_ready:
            fallback = await self._cpu_fallback(rt)
            if fallback:
                if rt.health != "unhealthy":
                    log.error("shard_on_cpu", shard=rt.shard_id, reason=fallback)
                rt.health = "unhealthy"
                rt.health_reason = fallback
                return
        before = rt.health
        if state == "ready":
            rt.health = "ready"
            rt.was_ready = True
            rt.health_reason = ""
        elif state == "loading":
            started = rt.started_mono
            if started is not None and now - started > self.cfg.start_timeout_s:
                rt.health = "unhealthy"
                rt.health_reason = (
                    f"not ready after {self.cfg.start_timeout_s:g}s (agent.start_timeout_s)"
                )
            else:
                rt.health = "starting"
        else:
            rt.health = "unhealthy"
            rt.health_reason = f"{engine.health_path} answered {status}"
        if rt.health != before:
            log.info("shard_health_changed", shard=rt.shard_id, health=rt.health, status=status)
            if rt.health == "ready":
                # A shard that came up is no longer in a crash loop.
                rt.consecutive_failures = 0

    async def _cpu_fallback(self, rt: ShardRuntime) -> str:
        """Why a shard placed on GPUs is serving from the CPU, or "" (seed CPUFallback).

        Some engines (llama.cpp) come up on the CPU when their build lacks the GPU
        backend, answer health checks and serve, at a fraction of the speed the
        placement paid for. Such a shard is never ready. Asked once per start.
        """
        engine, rec = rt.engine, rt.record
        if engine is None or not engine.falls_back_to_cpu or not rec.spec.get("gpu_indices"):
            return ""
        if rt.cpu_checked_generation == rec.generation:
            return rt.cpu_fallback
        rt.cpu_checked_generation = rec.generation
        from llmgw.engines import Command
        from llmgw.engines.llamacpp import CPU_FALLBACK_LOG_MARKERS, parse_devices

        tail = log_tail(rt.dir / "logs", "", max_chars=65536)
        marker = next((m for m in CPU_FALLBACK_LOG_MARKERS if m in tail), None)
        if marker is not None:
            rt.cpu_fallback = f"the engine is serving from the CPU: its log says {marker!r}"
            return rt.cpu_fallback
        probe = engine.list_devices_command(Command(name="devices", path=rec.engine_path))
        if probe is None or not rec.engine_path:
            return ""
        env = {**self._wrapper_env, "CUDA_VISIBLE_DEVICES": rec.visible_devices}
        try:
            out = await asyncio.to_thread(
                subprocess.run,
                [probe[0], *probe[1]],
                env=env,
                capture_output=True,
                timeout=60,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            rt.cpu_fallback = f"cannot ask the engine which GPUs it sees: {e}"
            return rt.cpu_fallback
        devices = parse_devices(out.stdout.decode(errors="replace"))
        if not devices:
            rt.cpu_fallback = (
                f"the engine's build sees no GPU ({probe[0]} {' '.join(probe[1])} listed none "
                f"with CUDA_VISIBLE_DEVICES={rec.visible_devices}); it would serve from the CPU"
            )
        return rt.cpu_fallback

    # --- reporting ----------------------------------------------------------------

    def bindings(self, *, proxy_url: Callable[[str], str] = lambda _sid: "") -> list[ShardBinding]:
        now = self._clock()
        out: list[ShardBinding] = []
        seen: set[str] = set()
        for sid, rt in sorted(self.runtimes.items()):
            seen.add(sid)
            p = self._prepared(sid)
            extra = ""
            if p is not None and p.error:
                extra = f"desired spec refused: {p.error}"
            elif sid in self.notes:
                extra = self.notes[sid]
            out.append(
                rt.binding(
                    crash_loop_after=self.cfg.crash_loop_after,
                    boot_id=self.boot_id,
                    now=now,
                    proxy_url=proxy_url(sid),
                    extra_reason=extra,
                )
            )
        for sid, p in sorted((self.desired or {}).items()):
            if sid in seen or p.desired.desired_state == "stopped":
                continue
            reason = p.error or self.notes.get(sid, "")
            if reason:
                seen.add(sid)
                out.append(
                    ShardBinding(shard_id=sid, observed_state="failed", reason=reason[:2048])
                )
        for sid, reason in sorted(self.notes.items()):
            if sid not in seen:
                out.append(
                    ShardBinding(shard_id=sid, observed_state="failed", reason=reason[:2048])
                )
        return out

    def count_by_state(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for b in self.bindings():
            counts[b.observed_state] = counts.get(b.observed_state, 0) + 1
        return counts

    async def idle(self) -> None:
        """Wait for background stops to finish (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Release the agent's resources; every engine keeps running."""
        await self._client.aclose()


def _spawn(argv: list[str], env: dict[str, str], shard_dir: Path) -> subprocess.Popen[bytes]:
    """Start a wrapper in its own session, output to its own file: nothing ties it to the agent."""
    with (shard_dir / "wrapper.log").open("ab") as wlog:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=wlog,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=shard_dir,
            start_new_session=True,
            close_fds=True,
        )


def _feed(popen: subprocess.Popen[bytes], data: bytes) -> None:
    """Hand the launch to a new wrapper and close the pipe: afterwards nothing links them."""
    assert popen.stdin is not None
    try:
        popen.stdin.write(data)
    except BrokenPipeError:
        # The wrapper died at once; its exit is observed on the next pass.
        pass
    finally:
        with contextlib.suppress(BrokenPipeError):
            popen.stdin.close()
