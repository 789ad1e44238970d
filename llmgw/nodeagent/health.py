"""What the supervisor asks of running engines: their health endpoints, whether one that
answers ready is really on its GPUs, and suspend/resume over HTTP.

A probe only moves a runtime's health fields (and ``suspended``); which engines to probe, and
what follows from the answer, is the supervisor's (supervisor.py). Whether an engine serves
from the CPU is read through the Engine interface (``cpu_fallback_in_log``,
``list_devices_command``, ``listed_devices``): this module knows no engine by name. It must
NOT start, stop or signal a shard's processes.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterable, Mapping

import httpx

from llmgw.engines import Command
from llmgw.logs import get_logger
from llmgw.nodeagent.runtime import ShardRuntime, log_tail
from llmgw.nodeagent.supervisor_config import SupervisorConfig

__all__ = ["HealthProber"]

# The supervisor's logger: these events were the supervisor's own before it was split up, and
# whoever reads the logs finds them where they were.
log = get_logger("llmgw.nodeagent.supervisor")


class HealthProber:
    """Probes every running leader's health endpoint and suspends or resumes engines."""

    def __init__(self, config: SupervisorConfig, *, wrapper_env: Mapping[str, str]) -> None:
        self.cfg = config
        self._wrapper_env = wrapper_env
        self._client = httpx.AsyncClient(timeout=config.health_timeout_s, trust_env=False)
        self._control_client = httpx.AsyncClient(timeout=config.control_timeout_s, trust_env=False)

    async def probe_all(self, runtimes: Iterable[ShardRuntime], now: float) -> None:
        live = [rt for rt in runtimes if rt.phase in ("live", "unadopted")]
        if live:
            await asyncio.gather(*(self._probe(rt, now) for rt in live))

    async def _probe(self, rt: ShardRuntime, now: float) -> None:
        engine = rt.engine
        spec = rt.record.spec_view
        if engine is None or not spec.leader or rt.record.http_port <= 0:
            # A rank that serves no HTTP is ready while its processes run.
            rt.health = "ready"
            return
        url = f"http://{spec.engine_host}:{rt.record.http_port}{engine.health_path}"
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
        if engine is None or not engine.falls_back_to_cpu or not rec.spec_view.gpu_indices:
            return ""
        if rt.cpu_checked_generation == rec.generation:
            return rt.cpu_fallback
        rt.cpu_checked_generation = rec.generation
        said = engine.cpu_fallback_in_log(log_tail(rt.dir / "logs", "", max_chars=65536))
        if said:
            rt.cpu_fallback = f"the engine is serving from the CPU: its log says {said!r}"
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
        if not engine.listed_devices(out.stdout.decode(errors="replace")):
            rt.cpu_fallback = (
                f"the engine's build sees no GPU ({probe[0]} {' '.join(probe[1])} listed none "
                f"with CUDA_VISIBLE_DEVICES={rec.visible_devices}); it would serve from the CPU"
            )
        return rt.cpu_fallback

    async def control(self, rt: ShardRuntime, what: str) -> None:
        """Suspend (free the GPUs, keep the process) or resume an engine that supports it, with
        the engine's own calls (``Engine.suspend_calls``, ``resume_calls``). A step already
        done answers 409, which is not a failure.
        """
        engine = rt.engine
        if engine is None:
            return
        base = f"http://{rt.record.spec_view.engine_host}:{rt.record.http_port}"
        steps = engine.suspend_calls if what == "suspend" else engine.resume_calls
        for step in steps:
            try:
                r = await self._control_client.post(f"{base}{step}")
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

    async def close(self) -> None:
        await self._client.aclose()
        await self._control_client.aclose()
