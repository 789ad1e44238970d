"""Runtime LoRA adapters in running engines: the shell of adapter_diff.py (issue [lora]).

After each supervisor pass the agent hands this its shards (`follow`). For every rank-0 shard
whose engine loads adapters at runtime (``Engine.runtime_adapters``) and was started with
``adapter_slots`` > 0, it converges the engine's runtime adapters to the shard's
``DesiredShard.adapters`` without restarting anything: one background task per engine (the
supervisor's pass never waits for a load, as it never waits for a stop), making one call at a
time, each under ``call_timeout_s``, on the engine's own port on loopback with the shard's
API key, as the agent's other calls to engines do (health.py). The front door refuses these
routes (proxy.py): only the agent calls them.

What an engine holds is learnt from the engine. When the agent first sees an engine process
(a start, a restart, an adoption) it reads the engine's list (``RuntimeAdapterApi.list_path``)
before any call, and reads it again after a call whose outcome it could not read (a timeout:
the load may have happened). A new process holds none of its predecessor's runtime adapters,
so an engine that restarted gets them loaded again. Between an agent's start and its first
sync (the engine's key comes with the desired set) it reports what the adapters file of the
shard says the process holds (records.ShardAdapters), so adopting an engine never makes the
gateways stop sending it its adapters' requests.

Paths: a directory must pass the node's policy (agent.policy.allowed_adapter_sources, else
allowed_model_roots), as a profile's adapters do (policy.adapter_source_problem); an http(s)
source is downloaded first under the same rules (adapters.fetch_adapter). A refused or failed
path, like a load the engine refuses, is a failed adapter with its reason, tried again with
backoff (llmgw.periodic.backoff_delay): the operator may fix the path, the file or the policy.
Such failures are warnings with the reason, never tracebacks: they are the operator's to fix.

This module must NOT decide which calls to make (adapter_diff.py), nor start, stop or signal
any process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmgw.engines.engine import host_port
from llmgw.engines.runtime_adapters import AdapterAnswer, EngineCall, RuntimeAdapterApi
from llmgw.http.bodies import BodyTooLarge, read_capped
from llmgw.logs import get_logger
from llmgw.nodeagent.adapter_diff import (
    AdapterCall,
    KnownAdapter,
    WantedAdapter,
    observed_adapters,
    plan_adapters,
)
from llmgw.nodeagent.adapters import AdapterFetchError, adapter_path_for, fetch_adapter, is_url
from llmgw.nodeagent.policy import LocalPolicy, adapter_source_problem
from llmgw.nodeagent.records import ShardAdapters, read_adapters, write_model
from llmgw.nodeagent.runtime import ShardRuntime
from llmgw.periodic import backoff_delay
from llmgw.protocol.sync import AdapterObserved

__all__ = ["AdapterCounts", "AdapterSync", "AdapterSyncConfig"]

log = get_logger("llmgw.nodeagent.adapters")

_ADAPTERS_FILE = "adapters.json"
_MAX_QUOTED_CHARS = 300
# An engine's answer read at most this far: a model list of the most adapters an engine holds
# (protocol.MAX_RUNTIME_ADAPTERS, each a name and a path) is well under it, and a broken or
# hostile engine must not make the agent hold whatever it sends.
_MAX_ANSWER_BYTES = 4 << 20

# The process a shard's engine is: the record's generation (bumped on every start) and its
# wrapper (pid and start time). A different one holds none of the previous one's adapters.
Incarnation = tuple[int, int | None, int | None]


@dataclass(frozen=True, slots=True)
class AdapterSyncConfig:
    # Where http(s) sources are stored once downloaded (adapters.py), shared with profiles'.
    adapter_root: Path
    adapter_max_bytes: int = 2 << 30
    adapter_allow_loopback: bool = False
    # One load, unload or list call: a load reads the adapter from disk into the engine.
    call_timeout_s: float = 120.0
    # After failed calls in a row: backoff_delay(failures - 1, retry_min_s, retry_max_s).
    retry_min_s: float = 5.0
    retry_max_s: float = 300.0


@dataclass(frozen=True, slots=True)
class AdapterCounts:
    """One shard's runtime adapter calls since the agent started, for /metrics."""

    shard: str
    loads_ok: int
    loads_failed: int
    unloads: int
    # Runtime adapters the engine holds as far as the agent knows.
    loaded: int


@dataclass(frozen=True, slots=True)
class _Target:
    """One engine's adapters as they should be, from its shard as the supervisor last saw it."""

    incarnation: Incarnation
    dir: Path
    api: RuntimeAdapterApi
    base_url: str
    # What the engine was started with (its record's spec), not what a newer spec says.
    slots: int
    static: frozenset[str]
    # None: the placement is not known (no desired set yet, or the shard is being stopped):
    # what the engine holds is reported, nothing is called.
    wanted: tuple[WantedAdapter, ...] | None
    # Each wanted adapter's path as placed (a directory, or an http(s) source).
    sources: Mapping[str, str]
    api_key: str = field(repr=False)
    ready: bool


@dataclass
class _Engine:
    target: _Target
    known: dict[str, KnownAdapter] = field(default_factory=dict)
    # Whether `known` was read from the engine since this process was first seen.
    listed: bool = False
    list_failures: int = 0
    list_retry_at: float = 0.0
    in_flight: AdapterCall | None = None
    task: asyncio.Task[None] | None = None
    # What the adapters file says now (not rewritten when unchanged).
    saved: dict[str, str] | None = None
    loads_ok: int = 0
    loads_failed: int = 0
    unloads: int = 0


class AdapterSync:
    """Converges every eligible engine's runtime adapters; reports them for the bindings."""

    def __init__(
        self,
        config: AdapterSyncConfig,
        policy: LocalPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_change``: called when an engine's adapters changed (a load or unload answered,
        a load refused): the agent reports them at once rather than at its next sync, since
        requests wait in the gateways until the control plane hears of a load."""
        self.cfg = config
        self._policy = policy
        self._clock = clock
        self._on_change = on_change
        self._engines: dict[str, _Engine] = {}
        self._client = httpx.AsyncClient(timeout=config.call_timeout_s, trust_env=False)

    # --- following the supervisor ------------------------------------------------------

    def follow(self, runtimes: Mapping[str, ShardRuntime]) -> None:
        """Take in each shard's state after a supervisor pass; start converging what is due.
        Returns at once: the calls run in background tasks."""
        now = self._clock()
        seen: set[str] = set()
        for sid, rt in runtimes.items():
            target = self._target(rt)
            if target is None:
                continue
            seen.add(sid)
            e = self._engines.get(sid)
            if e is None:
                e = self._engines[sid] = _Engine(target, known=self._seed(target))
            elif e.target.incarnation != target.incarnation:
                held = sorted(n for n, k in e.known.items() if k.state == "loaded")
                if held:
                    log.info("adapters_engine_replaced", shard=sid, lost=held)
                e.known, e.listed, e.saved = {}, False, None
                e.list_failures, e.list_retry_at = 0, 0.0
            e.target = target
            if e.task is None and self._due(e, now):
                e.task = asyncio.create_task(self._converge(sid, e), name=f"adapters-{sid}")
        for sid in [s for s in self._engines if s not in seen]:
            gone = self._engines.pop(sid)
            if gone.task is not None:
                gone.task.cancel()

    def _target(self, rt: ShardRuntime) -> _Target | None:
        engine, rec = rt.engine, rt.record
        view = rec.spec_view
        api = engine.runtime_adapters if engine is not None else None
        if (
            api is None
            or view.adapter_slots <= 0
            or not view.leader
            or rec.http_port <= 0
            or rt.phase not in ("live", "unadopted")
        ):
            return None
        static = frozenset(view.adapter_names)
        p = rt.prepared
        wanted: list[WantedAdapter] | None = None
        sources: dict[str, str] = {}
        key = ""
        if p is not None and p.desired.desired_state != "stopped":
            key = p.desired.engine_api_key
            wanted = []
            for a in p.desired.adapters:
                # The profile's own adapters are the engine's since its start: never touched.
                if a.name in static or a.name in sources:
                    continue
                local = (
                    str(adapter_path_for(a.path, self.cfg.adapter_root))
                    if is_url(a.path)
                    else a.path
                )
                wanted.append(WantedAdapter(a.name, local, a.pinned))
                sources[a.name] = a.path
        return _Target(
            incarnation=(rec.generation, rec.wrapper_pid, rec.wrapper_start_time),
            dir=rt.dir,
            api=api,
            base_url=f"http://{host_port(view.engine_host, rec.http_port)}",
            slots=view.adapter_slots,
            static=static,
            wanted=tuple(wanted) if wanted is not None else None,
            sources=sources,
            api_key=key,
            ready=rt.phase == "live" and rt.health == "ready" and not rt.suspended,
        )

    def _seed(self, t: _Target) -> dict[str, KnownAdapter]:
        """What the shard's adapters file says this very process holds (an adopted engine),
        until the engine's own list is read."""
        saved = read_adapters(t.dir)
        if saved is None or (saved.generation, saved.wrapper_pid, saved.wrapper_start_time) != (
            t.incarnation
        ):
            return {}
        return {
            n: KnownAdapter(n, "loaded", path)
            for n, path in saved.loaded.items()
            if n not in t.static
        }

    def _due(self, e: _Engine, now: float) -> bool:
        t = e.target
        if t.wanted is None or not t.ready or not t.api_key:
            return False
        if not e.listed:
            return e.list_retry_at <= now
        plan = plan_adapters(t.wanted, e.known, slots=t.slots, now=now)
        return bool(plan.calls or plan.forget)

    # --- converging one engine ---------------------------------------------------------

    async def _converge(self, sid: str, e: _Engine) -> None:
        try:
            while True:
                t = e.target
                if self._engines.get(sid) is not e or t.wanted is None or not t.ready:
                    return
                if not t.api_key:
                    return
                now = self._clock()
                if not e.listed:
                    if e.list_retry_at > now:
                        return
                    await self._list(sid, e, t)
                    continue
                plan = plan_adapters(t.wanted, e.known, slots=t.slots, now=now)
                for name in plan.forget:
                    e.known.pop(name, None)
                if not plan.calls:
                    return
                await self._call(sid, e, t, plan.calls[0])
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug, not an engine's answer: logged with its trace, and this engine is read
            # again after a pause instead of looping on whatever went wrong.
            log.exception("adapter_sync_failed", shard=sid)
            e.listed = False
            e.list_failures += 1
            e.list_retry_at = self._clock() + self._backoff(e.list_failures)
        finally:
            e.task = None

    def _auth(self, t: _Target) -> dict[str, str]:
        return {"Authorization": f"Bearer {t.api_key}"}

    def _backoff(self, failures: int) -> float:
        return backoff_delay(failures - 1, self.cfg.retry_min_s, self.cfg.retry_max_s)

    async def _list(self, sid: str, e: _Engine, t: _Target) -> None:
        why = ""
        held: dict[str, str] | None = None
        try:
            status, text = await self._request("GET", t.base_url + t.api.list_path, t)
            if status == 200:
                held = t.api.listed(text)
            if held is None:
                why = f"{t.api.list_path} answered {status}: {text[:_MAX_QUOTED_CHARS]}"
        except httpx.HTTPError as exc:
            why = f"no answer from the engine: {type(exc).__name__}: {exc}"
        if e.target.incarnation != t.incarnation or self._engines.get(sid) is not e:
            return
        if held is None:
            e.list_failures += 1
            delay = self._backoff(e.list_failures)
            e.list_retry_at = self._clock() + delay
            log.warning(
                "adapters_list_failed",
                shard=sid,
                reason=why,
                failures=e.list_failures,
                retry_in_s=round(delay, 2),
            )
            return
        known = {
            n: KnownAdapter(n, "loaded", path) for n, path in held.items() if n not in t.static
        }
        # A failed load left nothing in the engine; its backoff goes on.
        for n, k in e.known.items():
            if k.state == "failed" and n not in known:
                known[n] = k
        e.known, e.listed, e.list_failures = known, True, 0
        log.info(
            "adapters_listed",
            shard=sid,
            held=sorted(n for n, k in known.items() if k.state == "loaded"),
        )
        await self._save(e, t)

    async def _call(self, sid: str, e: _Engine, t: _Target, call: AdapterCall) -> None:
        e.in_flight = call
        started = self._clock()
        unanswered = False
        cause = "engine"
        path = call.path
        try:
            if call.kind == "load":
                source = t.sources.get(call.name, call.path)
                local, refused = await self._local_path(call.name, source)
                if local is None:
                    answer, cause = AdapterAnswer("failed", refused), "node"
                else:
                    path = local
                    answer, unanswered = await self._post(
                        t, t.api.load(call.name, local), t.api.load_answer
                    )
            else:
                # Forgotten in the file before the engine forgets it: the file never names an
                # adapter the engine may no longer hold.
                await self._save(e, t, without=call.name)
                answer, unanswered = await self._post(
                    t, t.api.unload(call.name), t.api.unload_answer
                )
        finally:
            e.in_flight = None
        if e.target.incarnation != t.incarnation or self._engines.get(sid) is not e:
            return  # the process it was made to is gone, and its adapters with it
        now = self._clock()
        if unanswered:
            # It may have taken effect all the same: read the engine before the next call.
            e.listed = False
        if call.kind == "load":
            self._after_load(sid, e, call, path, answer, cause, now, now - started)
        else:
            self._after_unload(sid, e, call, answer, now)
        await self._save(e, t)
        self._on_change()

    async def _local_path(self, name: str, source: str) -> tuple[str | None, str]:
        """The directory to hand the engine, or None and why this node will not."""
        problem = adapter_source_problem(name, source, self._policy)
        if problem is not None:
            return None, problem
        if not is_url(source):
            return source, ""
        try:
            local = await fetch_adapter(
                source,
                self.cfg.adapter_root,
                max_bytes=self.cfg.adapter_max_bytes,
                allow_loopback=self.cfg.adapter_allow_loopback,
                timeout_s=self.cfg.call_timeout_s,
            )
        except AdapterFetchError as exc:
            return None, str(exc)
        except (httpx.HTTPError, OSError) as exc:
            return None, f"adapter {name!r} source {source!r}: {type(exc).__name__}: {exc}"
        return str(local), ""

    async def _post(
        self, t: _Target, call: EngineCall, read: Callable[[int, str], AdapterAnswer]
    ) -> tuple[AdapterAnswer, bool]:
        """The engine's answer, and whether it gave none (the call may have taken effect)."""
        try:
            status, text = await self._request("POST", t.base_url + call.path, t, call.body)
        except httpx.TimeoutException as exc:
            return AdapterAnswer(
                "failed",
                f"no answer from the engine within {self.cfg.call_timeout_s:g}s "
                f"({type(exc).__name__})",
            ), True
        except httpx.HTTPError as exc:
            return AdapterAnswer(
                "failed", f"no answer from the engine: {type(exc).__name__}: {exc}"
            ), True
        return read(status, text), False

    async def _request(
        self, method: str, url: str, t: _Target, body: object = None
    ) -> tuple[int, str]:
        """(status, text) of one call to the engine, its answer read at most
        ``_MAX_ANSWER_BYTES`` (past it, the text says so: a load's or list's reason)."""
        async with self._client.stream(method, url, json=body, headers=self._auth(t)) as r:
            try:
                raw = await read_capped(
                    r.aiter_bytes(), _MAX_ANSWER_BYTES, _declared_length(r.headers)
                )
            except BodyTooLarge:
                return r.status_code, f"an answer over {_MAX_ANSWER_BYTES} bytes"
            return r.status_code, raw.decode(errors="replace")

    def _after_load(
        self,
        sid: str,
        e: _Engine,
        call: AdapterCall,
        path: str,
        answer: AdapterAnswer,
        cause: str,
        now: float,
        seconds: float,
    ) -> None:
        name = call.name
        if answer.outcome in ("ok", "already"):
            e.known[name] = KnownAdapter(name, "loaded", path)
            e.loads_ok += 1
            if answer.outcome == "already":
                # Loaded by an earlier agent, or a call that timed out: by which path, only
                # the engine's list says.
                e.listed = False
                log.info("adapter_already_loaded", shard=sid, adapter=name, answer=answer.reason)
            else:
                log.info(
                    "adapter_loaded", shard=sid, adapter=name, path=path, seconds=round(seconds, 3)
                )
            return
        prev = e.known.get(name)
        failures = (prev.failures if prev is not None and prev.state == "failed" else 0) + 1
        delay = self._backoff(failures)
        e.known[name] = KnownAdapter(
            name, "failed", failures=failures, retry_at=now + delay, reason=answer.reason
        )
        e.loads_failed += 1
        log.warning(
            "adapter_load_failed",
            shard=sid,
            adapter=name,
            path=path,
            cause=cause,
            reason=answer.reason,
            failures=failures,
            retry_in_s=round(delay, 2),
        )

    def _after_unload(
        self, sid: str, e: _Engine, call: AdapterCall, answer: AdapterAnswer, now: float
    ) -> None:
        name = call.name
        if answer.outcome in ("ok", "absent"):
            e.known.pop(name, None)
            if answer.outcome == "ok":
                e.unloads += 1
                log.info("adapter_unloaded", shard=sid, adapter=name, why=call.reason)
            else:
                log.info("adapter_already_unloaded", shard=sid, adapter=name, answer=answer.reason)
            return
        prev = e.known.get(name)
        failures = (prev.failures if prev is not None else 0) + 1
        delay = self._backoff(failures)
        e.known[name] = KnownAdapter(
            name,
            "loaded",
            prev.path if prev is not None else "",
            failures=failures,
            retry_at=now + delay,
            reason=f"unload failed: {answer.reason}",
        )
        log.warning(
            "adapter_unload_failed",
            shard=sid,
            adapter=name,
            reason=answer.reason,
            failures=failures,
            retry_in_s=round(delay, 2),
        )

    async def _save(self, e: _Engine, t: _Target, *, without: str = "") -> None:
        """Write the shard's adapters file when what it would say changed."""
        loaded = {
            n: k.path for n, k in sorted(e.known.items()) if k.state == "loaded" and n != without
        }
        if loaded == e.saved:
            return
        generation, pid, start_time = t.incarnation
        doc = ShardAdapters(
            generation=generation, wrapper_pid=pid, wrapper_start_time=start_time, loaded=loaded
        )

        def write() -> bool:
            # Never recreate the directory of a shard forgotten meanwhile.
            if not (t.dir / "record.json").exists():
                return False
            write_model(t.dir / _ADAPTERS_FILE, doc)
            return True

        try:
            if await asyncio.to_thread(write):
                e.saved = loaded
        except OSError as exc:
            log.warning(
                "adapters_file_unwritable", path=str(t.dir / _ADAPTERS_FILE), error=str(exc)
            )

    # --- reporting ---------------------------------------------------------------------

    def observed(self) -> dict[str, tuple[AdapterObserved, ...]]:
        """Each tracked shard's runtime adapters, as its binding reports them."""
        now = self._clock()
        out: dict[str, tuple[AdapterObserved, ...]] = {}
        for sid, e in self._engines.items():
            t = e.target
            if not t.ready:
                waiting_for = "waiting for the engine to be ready"
            elif not e.listed:
                waiting_for = "reading which adapters the engine holds"
            else:
                waiting_for = ""
            out[sid] = observed_adapters(
                t.wanted,
                e.known,
                slots=t.slots,
                now=now,
                in_flight=e.in_flight,
                waiting_for=waiting_for,
            )
        return out

    def counts(self) -> list[AdapterCounts]:
        return [
            AdapterCounts(
                shard=sid,
                loads_ok=e.loads_ok,
                loads_failed=e.loads_failed,
                unloads=e.unloads,
                loaded=sum(1 for k in e.known.values() if k.state == "loaded"),
            )
            for sid, e in sorted(self._engines.items())
        ]

    async def idle(self) -> None:
        """Wait until no engine has a call under way (tests, shutdown)."""
        while tasks := [e.task for e in self._engines.values() if e.task is not None]:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        tasks = [e.task for e in self._engines.values() if e.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._client.aclose()


def _declared_length(headers: httpx.Headers) -> int | None:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None
