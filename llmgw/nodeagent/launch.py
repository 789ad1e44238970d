"""Starting and stopping shards for real: a wrapper spawned with its launch, stopped by
signals, and the shard's GPUs waited on until they show none of its processes.

A start is three steps, so the supervisor can book and act on what lies between them:
``build`` (the shard's directory, its adapters fetched, its ports and a CPU shard's cores, the
launch built from the node facts it is given; nothing runs yet, and every failure is a
``StartFailed`` to report and retry), ``write_record`` (the record on disk, which the
supervisor's hooks see before any engine runs) and ``spawn`` (the wrapper spawned and handed
its launch). Nothing here calls back into the supervisor.

The agent is never what keeps an engine alive: wrappers run in their own sessions, get the
launch on a pipe that is closed once written, and write their output to files. An agent that
exits (or is killed) leaves every engine running; the next agent finds them through their
records and adopts those it can prove are the same processes (records.py, procs.py).

This module must NOT decide what to start or stop (diff.py, supervisor.py), nor keep the
supervisor's books (its notes, retries, counters).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from llmgw.engines import Command, ShardSpec
from llmgw.errors import SpecError
from llmgw.logs import get_logger
from llmgw.nodeagent import procs
from llmgw.nodeagent.adapters import AdapterFetchError, fetch_adapter, is_url
from llmgw.nodeagent.cores import CoreAllocator
from llmgw.nodeagent.frontdoor import FrontDoorLaunch
from llmgw.nodeagent.inventory import GpuSource, allowed_cpus
from llmgw.nodeagent.ports import PortAllocator, PortsExhausted
from llmgw.nodeagent.prepare import (
    LaunchPorts,
    NodeFacts,
    PreparedShard,
    build_launch,
    spec_without_secrets,
)
from llmgw.nodeagent.records import RecordError, ShardRecord, safe_shard_dirname, write_model
from llmgw.nodeagent.runtime import ShardRuntime
from llmgw.nodeagent.shardprocs import wrapper_running
from llmgw.nodeagent.shardrun import ShardLaunch
from llmgw.nodeagent.supervisor_config import SupervisorConfig

__all__ = ["Launcher", "PendingStart", "StartFailed"]

# The supervisor's logger: these events were the supervisor's own before it was split up, and
# whoever reads the logs finds them where they were.
log = get_logger("llmgw.nodeagent.supervisor")


class StartFailed(Exception):
    """A start that could not happen before its wrapper ran; the message says why."""


@dataclass(frozen=True, slots=True)
class PendingStart:
    """A start built and not yet run: what ``Launcher.write_record`` and ``spawn`` run."""

    prepared: PreparedShard
    dir: Path
    ports: LaunchPorts
    spec: ShardSpec
    commands: list[Command]
    # The runtime of the shard's previous life on this node, if any.
    prev: ShardRuntime | None
    # The same desired spec run again after an exit of its own: a restart, not a new start.
    restarted: bool
    # The record's restart count for this start: one more after a restart, kept after a stop
    # that was asked for (records.ShardRecord.stopped_reason), zero for a new spec.
    restarts: int
    # The front door's port (a leader serving HTTP), else 0.
    proxy_port: int = 0


def _record_ports(rec: ShardRecord) -> tuple[int, int, int]:
    return rec.http_port, rec.kv_events_port, rec.kv_replay_port


class Launcher:
    """Builds and runs shard starts, stops wrappers, and owns the node's shard ports and the
    CPU shards' cores."""

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        gpu_source: GpuSource,
        wrapper_env: Mapping[str, str],
        boot_id: str,
    ) -> None:
        self.cfg = config
        self._gpus = gpu_source
        self._wrapper_env = wrapper_env
        self._boot_id = boot_id
        self.ports = PortAllocator(*config.port_range)
        self.proxy_ports = PortAllocator(
            *config.proxy_port_range, host=config.proxy_host, setting="agent.proxy_port_range"
        )
        self.cores = CoreAllocator(config.cpu_ids or allowed_cpus())
        self._warned_shared_cores = False

    # --- ports and directories -------------------------------------------------------

    def hold(self, rec: ShardRecord) -> None:
        """Keep a shard found on disk from losing its ports and cores to another start."""
        self.ports.hold(_record_ports(rec))
        self.proxy_ports.hold([rec.proxy_port])
        self.cores.hold(rec.spec_view.cpu_cores)

    def release(self, rt: ShardRuntime) -> None:
        """Give back what a forgotten shard held: its ports, its cores and its directory."""
        self.ports.release(_record_ports(rt.record))
        self.proxy_ports.release([rt.record.proxy_port])
        self.cores.release(rt.record.spec_view.cpu_cores)
        shutil.rmtree(rt.dir, ignore_errors=True)

    def shard_dir(self, shard_id: str) -> Path:
        try:
            return self.cfg.shards_root / safe_shard_dirname(shard_id)
        except RecordError as e:
            raise StartFailed(str(e)) from None

    # --- building a start ------------------------------------------------------------

    async def localize_adapters(self, p: PreparedShard) -> PreparedShard:
        """The prepared shard with every http(s) adapter replaced by its local copy."""
        if p.spec is None or not any(is_url(a.path) for a in p.spec.profile.adapters):
            return p
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
                except AdapterFetchError as e:
                    raise StartFailed(str(e)) from None
                except httpx.HTTPError as e:
                    raise StartFailed(f"adapter {a.name!r}: {type(e).__name__}: {e}") from None
                a = a.model_copy(update={"path": str(local)})
            adapters.append(a)
        profile = p.spec.profile.model_copy(update={"adapters": tuple(adapters)})
        return replace(p, spec=p.spec.model_copy(update={"profile": profile}))

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

    def _cores_for(self, p: PreparedShard, prev: ShardRecord | None) -> tuple[int, ...]:
        """A CPU shard's cores, for an engine that binds them: the previous life's while it
        asks for as many (an engine restarted where it ran), else a fresh pick (its old ones
        given back); () for any other shard. The count is the threads placement reserved
        (ShardSpec.threads), else the profile's."""
        spec, engine = p.spec, p.engine
        kept = prev.spec_view.cpu_cores if prev is not None else ()
        threads = 0
        if spec is not None and engine is not None and engine.binds_cpu_cores:
            threads = spec.num_threads if spec.profile.cpu_only else 0
        want = self.cores.size_for(threads)
        if len(kept) == want:
            return kept
        self.cores.release(kept)
        if want == 0:
            return ()
        pick = self.cores.allocate(threads)
        if pick.short and not self._warned_shared_cores:
            # Once per agent: an inventory that claims more threads than the node has would
            # say it again on every start.
            self._warned_shared_cores = True
            log.warning(
                "cpu_cores_shared",
                shard=p.shard_id,
                threads=threads,
                cores=list(pick.cores),
                cpus=len(self.cores.cpus),
                hint="placement reserved more CPU threads than this node has free, so CPU "
                "shards share cores (does agent.cpu_threads claim more than exist?)",
            )
        return pick.cores

    def _proxy_port_for(self, p: PreparedShard, prev: ShardRecord | None) -> int:
        """A front door for a leader that serves HTTP with a key: the previous one's port while
        free (the gateways hold its URL), else a fresh one. 0 for any other shard: a rank that
        serves no HTTP has nothing to guard, and without a key the proxy would admit anyone."""
        engine, spec = p.engine, p.spec
        if (
            engine is None
            or spec is None
            or not spec.leader
            or not engine.serves_http(spec)
            or not p.desired.engine_api_key
        ):
            return 0
        if prev is not None and prev.proxy_port:
            return self.proxy_ports.renew(prev.proxy_port)
        return self.proxy_ports.allocate()

    def build(
        self, p: PreparedShard, d: Path, prev_rt: ShardRuntime | None, *, facts: NodeFacts
    ) -> PendingStart:
        """Ports and the launch for a start in directory ``d``; StartFailed if none can be."""
        prev = prev_rt.record if prev_rt is not None else None
        try:
            proxy_port = self._proxy_port_for(p, prev)
        except PortsExhausted as e:
            raise StartFailed(str(e)) from None
        try:
            ports = self._ports_for(p, prev)
        except PortsExhausted as e:
            if proxy_port and (prev is None or prev.proxy_port != proxy_port):
                self.proxy_ports.release([proxy_port])
            raise StartFailed(str(e)) from None
        cores = self._cores_for(p, prev)
        try:
            spec, commands = build_launch(
                p, facts, ports, runtime_dir=str(d / "run"), cpu_cores=cores
            )
        except SpecError as e:
            # Ports not yet in a record go back to the pool: a start that keeps
            # failing must not drain the range.
            kept = set(_record_ports(prev)) if prev else set()
            self.ports.release(
                x
                for x in (ports.http_port, ports.kv_events_port, ports.kv_replay_port)
                if x not in kept
            )
            if proxy_port and (prev is None or prev.proxy_port != proxy_port):
                self.proxy_ports.release([proxy_port])
            # Cores likewise; the record still names the previous life's, held again.
            kept_cores = prev.spec_view.cpu_cores if prev is not None else ()
            if cores != kept_cores:
                self.cores.release(cores)
                self.cores.hold(kept_cores)
            raise StartFailed(e.message) from None
        same_spec = prev is not None and prev.digest == p.digest
        # A shard stopped on purpose (its agent exiting) comes back with a start, not a
        # restart: nothing crashed, and a count that grew with every Ctrl-C of `llmgw up`
        # would hide the crashes it is there to show. exits.py clears the reason when what
        # ended the shard was not that stop.
        restarted = same_spec and prev is not None and not prev.stopped_reason
        restarts = 0 if prev is None or not same_spec else prev.restarts + int(restarted)
        return PendingStart(
            p, d, ports, spec, commands, prev_rt, restarted, restarts, proxy_port=proxy_port
        )

    # --- running it ------------------------------------------------------------------

    def write_record(self, pending: PendingStart) -> ShardRecord:
        """The start's record, written to its directory (cleared of the last life's files)."""
        p, d, ports, commands = pending.prepared, pending.dir, pending.ports, pending.commands
        prev = pending.prev.record if pending.prev is not None else None
        engine = p.engine
        assert engine is not None  # launchable implies an engine
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        # A new process holds no runtime adapters (adapter_sync.py).
        for stale in ("exit.json", "procs.json", "adapters.json"):
            (d / stale).unlink(missing_ok=True)
        rec = ShardRecord(
            shard_id=p.shard_id,
            replica_id=p.desired.replica_id,
            fingerprint=p.desired.fingerprint,
            digest=p.digest,
            spec=spec_without_secrets(pending.spec),
            engine=engine.name,
            model=p.desired.model,
            boot_id=self._boot_id,
            http_port=ports.http_port,
            kv_events_port=ports.kv_events_port,
            kv_replay_port=ports.kv_replay_port,
            proxy_port=pending.proxy_port,
            started_at=time.time(),
            engine_path=commands[-1].path if commands else "",
            visible_devices=commands[-1].env.get("CUDA_VISIBLE_DEVICES", "") if commands else "",
            restarts=pending.restarts,
            generation=(prev.generation + 1) if prev is not None else 1,
        )
        # Written before the wrapper exists: an agent killed in between
        # leaves a record without a pid, and the next one kills the orphan by
        # its marker instead of losing track of it.
        write_model(d / "record.json", rec)
        return rec

    async def spawn(self, pending: PendingStart, rec: ShardRecord, now: float) -> ShardRuntime:
        """Spawn the wrapper of a start whose record ``write_record`` wrote, hand it its launch
        and note its pid in the record."""
        p, d, ports, commands = pending.prepared, pending.dir, pending.ports, pending.commands
        prev_rt, restarted = pending.prev, pending.restarted
        shard_id = p.shard_id
        launch = ShardLaunch(
            shard_id=shard_id,
            shard_dir=str(d),
            commands=tuple(commands),
            leader_addr=pending.spec.leader_addr,
            leader_port=pending.spec.leader_port,
            leader_wait_s=self.cfg.leader_wait_s,
            grace_s=self.cfg.stop_grace_s,
            log_max_bytes=self.cfg.log_max_bytes,
            log_backups=self.cfg.log_backups,
            proxy=self._front_door(pending),
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
        log.info(
            "shard_started",
            shard=shard_id,
            wrapper_pid=popen.pid,
            http_port=ports.http_port,
            proxy_port=pending.proxy_port,
            generation=rec.generation,
            restarts=rec.restarts,
        )
        return ShardRuntime(
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

    def _front_door(self, pending: PendingStart) -> FrontDoorLaunch | None:
        if not pending.proxy_port:
            return None
        cfg = self.cfg
        return FrontDoorLaunch(
            host=cfg.proxy_host,
            port=pending.proxy_port,
            upstream_port=pending.ports.http_port,
            api_key=pending.prepared.desired.engine_api_key,
            metrics_token=cfg.proxy_metrics_token,
            max_body_bytes=cfg.proxy_max_body_bytes,
            max_connections=cfg.proxy_max_connections,
            max_header_bytes=cfg.max_header_bytes,
            header_timeout_s=cfg.header_timeout_s,
        )

    async def stop(self, rt: ShardRuntime, *, on_purpose: str = "") -> None:
        """Stop the shard's wrapper and every marked process; wait until its GPUs are free.

        ``on_purpose``: why, for a stop whose record is kept for a later start (the agent
        exiting); noted in the record (``stopped_reason``) before the wrapper is signalled, so
        that even an agent killed mid-stop leaves the next one a stop, not a crash, to read."""
        pid = rt.record.wrapper_pid
        running = wrapper_running(rt)
        if on_purpose and running:
            rt.record = rt.record.model_copy(update={"stopped_reason": on_purpose})
            write_model(rt.dir / "record.json", rt.record)
        if running and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            # The wrapper itself escalates to SIGKILL after the grace period.
            deadline = time.monotonic() + self.cfg.stop_grace_s + 10
            while time.monotonic() < deadline:
                if not wrapper_running(rt):
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

    async def _wait_gpus_free(self, rt: ShardRuntime) -> None:
        """Where NVML exists, the shard's GPUs must show none of its processes."""
        indices = list(rt.record.spec_view.gpu_indices)
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
