"""The supervisor's shell: each pass applies what the pure core (diff.py) says to the shards.

Each pass (`tick`) observes (which wrappers ended: exits.py; how each engine's health
endpoint answers: health.py), asks `diff.compute_plan` what to do, and does it: starts and
stops through launch.py, suspend and resume through health.py. Stops run as background tasks
(a grace period can be minutes), so one slow engine never holds up the others. What runs is
never tied to the agent (launch.py): an agent that restarts adopts it (`recover`).

Before the control plane has said what it wants (the first sync after a
start, or while it is unreachable after a start) nothing is started,
stopped or adopted: the agent only watches and reports (fail static).

This module keeps the books (the runtimes, the notes reported for shards without one, the
start retries, the counters). It must NOT itself spawn or signal a process, nor ask an
engine anything.

Every call runs down: the pass calls into exits.py, launch.py and health.py (each over
runtime.py, records.py, shardprocs.py, procs.py), and none of them calls back up; what happens
between two steps of a start (the hooks told of a record before its engine runs) happens here,
between ``Launcher.write_record`` and ``Launcher.spawn``. The node facts a start is built from
are handed down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from llmgw.engines import EngineRegistry
from llmgw.errors import SpecError
from llmgw.logs import get_logger
from llmgw.nodeagent import procs
from llmgw.nodeagent.diff import Action, DesiredView, Plan, compute_plan
from llmgw.nodeagent.exits import found_exited, observe_exits, refresh_engine_pid
from llmgw.nodeagent.health import HealthProber
from llmgw.nodeagent.inventory import GpuSource
from llmgw.nodeagent.launch import Launcher, StartFailed
from llmgw.nodeagent.prepare import NodeFacts, PreparedShard, prepare
from llmgw.nodeagent.records import RecordError, ShardRecord, list_shard_dirs, read_record
from llmgw.nodeagent.runtime import ShardRuntime
from llmgw.nodeagent.shardprocs import kill_leftovers
from llmgw.nodeagent.supervisor_config import SupervisorConfig
from llmgw.protocol import DesiredShard, ShardBinding
from llmgw.protocol.sync import AdapterObserved

__all__ = ["ShardHooks", "Supervisor"]

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
        self._clock = clock
        self.runtimes: dict[str, ShardRuntime] = {}
        self.boot_id = procs.boot_id()
        env = dict(wrapper_env)
        self._launcher = Launcher(
            config, gpu_source=gpu_source, wrapper_env=env, boot_id=self.boot_id
        )
        self._health = HealthProber(config, wrapper_env=env)
        # Desired shards as last prepared; None until the control plane answered.
        self.desired: dict[str, PreparedShard] | None = None
        self.confirmed_drain = False
        # Shards reported without a runtime: unreadable records, refused specs.
        self.notes: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Shards with a suspend or resume call under way.
        self._controlling: set[str] = set()
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
                kill_leftovers(d.name)
                shutil.rmtree(d, ignore_errors=True)
                continue
            except RecordError as e:
                self._quarantine(d, str(e))
                continue
            self._launcher.hold(rec)
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
                refresh_engine_pid(rt)
                log.info(
                    "shard_found_running",
                    shard=rec.shard_id,
                    pid=rec.wrapper_pid,
                    engine_pid=rt.engine_pid,
                )
            else:
                found_exited(rt, now)
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

    # --- desired set -------------------------------------------------------------

    def set_desired(self, shards: Sequence[DesiredShard], *, confirmed_drain: bool) -> None:
        facts = self._facts()
        prepared: dict[str, PreparedShard] = {}
        old = self.desired or {}
        for d in shards:
            prev = old.get(d.shard_id)
            if prev is not None and prev.desired == d:
                p = prev
            elif prev is not None and prev.desired.model_copy(update={"adapters": d.adapters}) == d:
                # Only the runtime adapters changed: no part of the launch (nor its digest)
                # did, so nothing is prepared again (adapter_sync.py loads them).
                p = replace(prev, desired=d)
            else:
                p = prepare(d, self.registry, facts)
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
        observe_exits(self.runtimes.values(), now, self.cfg)
        plan: Plan | None = None
        if self.desired is not None:
            for sid in sorted(self._quarantined):
                p = self.desired.get(sid)
                if p is None or p.desired.desired_state == "stopped":
                    kill_leftovers(sid)
                    self.notes.pop(sid, None)
                    self._quarantined.discard(sid)
            plan = compute_plan(
                self._desired_views(),
                {sid: rt.view() for sid, rt in self.runtimes.items()},
                now=now,
                confirmed_drain=self.confirmed_drain,
            )
            await self._apply(plan, now)
        await self._health.probe_all(self.runtimes.values(), now)
        return plan

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
            self._begin_control(rt, a.kind)

    def _prepared(self, shard_id: str) -> PreparedShard | None:
        return (self.desired or {}).get(shard_id)

    async def _start(self, shard_id: str, now: float) -> None:
        p = self._prepared(shard_id)
        if p is None or not p.launchable or p.engine is None:
            return
        prev_rt = self.runtimes.get(shard_id)
        if self._retry_at.get(shard_id, 0.0) > now:
            return
        try:
            d = self._launcher.shard_dir(shard_id)
            p = await self._launcher.localize_adapters(p)
            if prev_rt is None:
                # Nothing of an earlier life (an unreadable record) may hold its ports or GPUs.
                kill_leftovers(shard_id)
                self._quarantined.discard(shard_id)
            pending = self._launcher.build(p, d, prev_rt, facts=self._facts())
        except StartFailed as e:
            self._start_failed(shard_id, str(e), now)
            return
        self.notes.pop(shard_id, None)
        self._retry_at.pop(shard_id, None)
        rec = self._launcher.write_record(pending)
        # The KV listener binds before the engine's PUB connects: frames sent to a port nobody
        # polls are lost.
        await self._hook(self.hooks.before_start, rec)
        self.runtimes[shard_id] = await self._launcher.spawn(pending, rec, now)
        self.counters["restarts" if pending.restarted else "starts"] += 1

    def _start_failed(self, shard_id: str, why: str, now: float) -> None:
        """Report a start that could not happen; retry later, log once per distinct reason."""
        if self.notes.get(shard_id) != why:
            log.error("shard_start_failed", shard=shard_id, error=why)
        self.notes[shard_id] = why
        self._retry_at[shard_id] = now + self.cfg.start_retry_s

    def _begin_control(self, rt: ShardRuntime, what: str) -> None:
        """Suspend or resume in the background: a vLLM sleep may take tens of seconds, which
        the loop (probes, other shards) must not wait for; one call at a time per shard."""
        if rt.shard_id in self._controlling:
            return
        self._controlling.add(rt.shard_id)
        task = asyncio.create_task(self._health.control(rt, what))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _t: self._controlling.discard(rt.shard_id))

    def _begin_stop(self, rt: ShardRuntime, *, then: str, on_purpose: str = "") -> None:
        rt.phase = "stopping"
        rt.after_stop = "restart" if then == "restart" else "forget"
        task = asyncio.create_task(self._stop(rt, on_purpose))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stop(self, rt: ShardRuntime, on_purpose: str = "") -> None:
        await self._launcher.stop(rt, on_purpose=on_purpose)
        self.counters["stops"] += 1
        log.info("shard_stopped", shard=rt.shard_id, then=rt.after_stop)
        if rt.after_stop == "forget":
            self._forget(rt)
        else:
            rt.replaced()

    async def stop_all(self, *, exit_reason: str) -> None:
        """Stop every shard and wait until all have stopped, keeping their records: the next
        agent starts the same shards at once (`llmgw agent --stop-engines-on-exit`).

        Each record that ran notes ``exit_reason`` as a stop asked for (launch.py), so the next
        agent reports that reason and starts the shard without counting a restart."""
        for rt in list(self.runtimes.values()):
            if rt.phase != "stopping":
                self._begin_stop(rt, then="restart", on_purpose=exit_reason)
        await self.idle()
        for rt in self.runtimes.values():
            rt.exit_reason = exit_reason

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
        self._launcher.release(rt)
        log.info("shard_forgotten", shard=rt.shard_id)

    # --- reporting ----------------------------------------------------------------

    def bindings(
        self,
        *,
        proxy_urls: Mapping[str, str] | None = None,
        adapters: Mapping[str, tuple[AdapterObserved, ...]] | None = None,
    ) -> list[ShardBinding]:
        """What the control plane is told of every shard; ``proxy_urls``: where the gateways
        reach each ready shard (agent.py knows, from the front doors and its shared proxy);
        ``adapters``: each engine's runtime adapters (adapter_sync.py)."""
        urls = proxy_urls or {}
        held = adapters or {}
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
                    proxy_url=urls.get(sid, ""),
                    extra_reason=extra,
                    adapters=held.get(sid, ()),
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
        await self._health.close()
