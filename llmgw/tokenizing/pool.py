"""A few tokenizing worker processes, each call with a hard deadline.

Why processes: ``tokenizers``' ``encode`` holds the GIL for the whole call and a chat template
renders in Python, so neither a thread pool nor a timeout protects the event loop (or the
other listeners on it) from a 4.5M-character render; a process does, and it can be killed.

- ``load(digest, files)``: every worker holds the tokenizer from then on (a worker started
  later loads it before it takes a call); the first load's outcome is the answer (None, or
  why the files are unusable: a set that fails once is not tried again, the digest names it);
  ``drop(digest)``: every worker lets it go when next idle.
- ``call(request, digest=..., wait_s=..., deadline_s=...)``: one request on an idle worker that
  holds ``digest``; the caller waits at most ``wait_s`` (then "timeout": it goes on without
  the answer) while the worker may go on to ``deadline_s``, past which it is killed and
  replaced ("deadline"; a worker that dies in a call is replaced too: "crashed", and one that
  dies idle at once). The work of an
  abandoned call is not wasted: its pieces stay in the worker's segment cache. More than
  ``max_waiting`` callers waiting for a worker: "busy", at once.
- Workers start on the first ``load`` or ``call``, never before: a process without tokenizer
  files has none.

What it must NOT do: block the loop (pipes are the loop's non-blocking streams, a request is
encoded once), or raise into the caller (every failure is a reason string).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from llmgw.logs import get_logger
from llmgw.tokenizing.protocol import (
    HEADER_BYTES,
    MAX_FRAME_BYTES,
    decode,
    encode,
    frame,
    frame_length,
)

__all__ = ["WorkerPool"]

log = get_logger("llmgw.tokenizing")

# A worker's address space before the tokenizers it holds (it needs ~60 MB; the rest is room
# for one render and its ids).
DEFAULT_MEMORY_BASE: Final = 1024 * 1024 * 1024
_RESPAWN_PAUSE_S: Final = 1.0
_STDERR_TAIL: Final = 4096
# Where this llmgw is imported from: the worker imports the same one.
_ROOT: Final = str(Path(__file__).resolve().parents[2])


@dataclass(eq=False)
class _Proc:
    proc: asyncio.subprocess.Process
    slot: int
    held: set[str] = field(default_factory=set)
    busy: bool = True  # from its start until its first loads are done
    dead: bool = False
    stderr: bytearray = field(default_factory=bytearray)


class WorkerPool:
    def __init__(
        self,
        *,
        workers: int,
        deadline_s: float,
        load_deadline_s: float = 60.0,
        max_waiting: int | None = None,
        memory_base: int = DEFAULT_MEMORY_BASE,
        name: str = "tokenize",
    ) -> None:
        self._size = max(1, workers)
        self._deadline_s = deadline_s
        self._load_deadline_s = load_deadline_s
        self._max_waiting = self._size * 4 if max_waiting is None else max_waiting
        self._memory_base = memory_base
        self._name = name
        self._procs: list[_Proc | None] = [None] * self._size
        self._starting: set[int] = set()
        self._spawn_failed_at = 0.0
        self._wanted: dict[str, Mapping[str, bytes]] = {}
        self._outcomes: dict[str, asyncio.Future[str | None]] = {}
        self._waiters: deque[tuple[str | None, asyncio.Future[_Proc]]] = deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.kills = 0  # workers killed past a deadline (tests, metrics)
        self.crashes = 0  # workers that died on their own

    # --- the tokenizers every worker holds ----------------------------------------------------

    async def load(self, digest: str, files: Mapping[str, bytes]) -> str | None:
        """Every worker holds the files' tokenizer from now on; None once one worker loaded
        it, else why it cannot (the same files are never tried again)."""
        outcome = self._outcomes.get(digest)
        if outcome is None:
            outcome = self._outcomes[digest] = asyncio.get_running_loop().create_future()
            self._wanted[digest] = files
            self._ensure_started()
            self._release_idle()  # an idle worker loads now
        return await asyncio.shield(outcome)

    def drop(self, digest: str) -> None:
        """The tokenizer is no longer wanted: every worker drops it when next idle (its memory
        and its share of the worker's address-space cap)."""
        self._wanted.pop(digest, None)
        self._outcomes.pop(digest, None)
        self._release_idle()

    def _release_idle(self) -> None:
        for proc in self._procs:
            if proc is not None and not proc.busy and not proc.dead:
                self._release(proc)

    def holds(self, digest: str) -> bool:
        outcome = self._outcomes.get(digest)
        return outcome is not None and outcome.done() and outcome.result() is None

    # --- calls --------------------------------------------------------------------------------

    async def call(
        self,
        request: dict[str, Any],
        *,
        digest: str | None,
        wait_s: float,
        deadline_s: float | None = None,
        on_done: Callable[[dict[str, Any] | str], None] | None = None,
    ) -> dict[str, Any] | str:
        """The worker's reply, or why none: "busy", "timeout" (not within ``wait_s``; the
        worker may go on), "deadline" (killed past ``deadline_s``), "crashed", "unencodable"
        (a value msgpack cannot carry, a request over the frame cap), "closed". ``on_done``:
        told the run's outcome when it ends, whether or not the caller still waits (a call it
        abandoned may still fail)."""
        if self._closed:
            return "closed"
        try:
            payload = frame(encode(request))
        except (TypeError, OverflowError, ValueError):
            return "unencodable"
        if len(payload) > HEADER_BYTES + MAX_FRAME_BYTES:
            # The worker would refuse the frame by dying: refused here, nobody's failure.
            return "unencodable"
        started = time.monotonic()
        proc = self._idle_with(digest)
        if proc is None:
            if len(self._waiters) >= self._max_waiting:
                return "busy"
            self._ensure_started()
            waiter: asyncio.Future[_Proc] = asyncio.get_running_loop().create_future()
            self._waiters.append((digest, waiter))
            try:
                proc = await asyncio.wait_for(asyncio.shield(waiter), wait_s)
            except TimeoutError:
                if waiter.done() and not waiter.cancelled():
                    self._release(waiter.result())  # handed over as the wait ended
                waiter.cancel()
                return "timeout"
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._release(waiter.result())
                waiter.cancel()
                raise
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove((digest, waiter))
        deadline = self._deadline_s if deadline_s is None else deadline_s
        task = self._spawn_task(self._run(proc, payload, deadline))
        if on_done is not None:
            task.add_done_callback(lambda t: None if t.cancelled() else on_done(t.result()))
        left = max(0.0, wait_s - (time.monotonic() - started))
        try:
            return await asyncio.wait_for(asyncio.shield(task), left)
        except TimeoutError:
            return "timeout"

    def _idle_with(self, digest: str | None) -> _Proc | None:
        for proc in self._procs:
            if (
                proc is not None
                and not proc.busy
                and not proc.dead
                and (digest is None or digest in proc.held)
            ):
                proc.busy = True
                return proc
        return None

    async def _run(self, proc: _Proc, payload: bytes, deadline_s: float) -> dict[str, Any] | str:
        got = await self._exchange(proc, payload, deadline_s)
        if not proc.dead:
            self._release(proc)
        return got

    async def _exchange(
        self, proc: _Proc, payload: bytes, deadline_s: float
    ) -> dict[str, Any] | str:
        stdin, stdout = proc.proc.stdin, proc.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            async with asyncio.timeout(deadline_s):
                stdin.write(payload)
                await stdin.drain()
                header = await stdout.readexactly(HEADER_BYTES)
                body = await stdout.readexactly(frame_length(header))
            got = decode(body)
        except TimeoutError:
            self.kills += 1
            self._replace(proc, f"a call ran past its deadline of {deadline_s:g} s")
            return "deadline"
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as exc:
            self.crashes += 1
            self._replace(proc, f"it died ({type(exc).__name__})")
            return "crashed"
        if got.get("kind") == "failed" and str(got.get("error", "")).startswith("MemoryError"):
            # It exits after this reply (a call's or a load's): replaced before it is reused.
            self._replace(proc, "it ran out of memory")
        return got

    def _release(self, proc: _Proc) -> None:
        """The worker is free: it loads what it lacks first, then takes the first waiter that
        wants a tokenizer it holds, else waits idle."""
        if proc.dead or self._closed:
            return
        proc.busy = True
        missing = [d for d in self._wanted if d not in proc.held]
        # Dropped (``drop``); a digest whose load failed elsewhere keeps its outcome, and
        # the worker that holds it keeps serving it.
        stale = [d for d in proc.held if d not in self._outcomes]
        if missing or stale:
            self._spawn_task(self._load_into(proc, missing, stale))
            return
        for digest, waiter in list(self._waiters):
            if not waiter.done() and (digest is None or digest in proc.held):
                self._waiters.remove((digest, waiter))
                waiter.set_result(proc)
                return
        proc.busy = False

    async def _load_into(self, proc: _Proc, digests: list[str], stale: list[str]) -> None:
        """The worker drops ``stale`` and loads ``digests``, then is free."""
        for digest in stale:
            drop = frame(encode({"op": "drop", "digest": digest}))
            await self._exchange(proc, drop, self._load_deadline_s)
            if proc.dead:
                return
            proc.held.discard(digest)
        for digest in digests:
            files = self._wanted.get(digest)
            if files is None:
                continue
            request = {"op": "load", "digest": digest, "files": dict(files)}
            got = await self._exchange(proc, frame(encode(request)), self._load_deadline_s)
            if isinstance(got, dict) and got.get("ok"):
                proc.held.add(digest)
                self._settle(digest, None)
                continue
            reason = got if isinstance(got, str) else str(got.get("error", "failed"))
            if got == "deadline":
                reason = f"loading took over {self._load_deadline_s:g} s"
            # Files that fail in one worker fail in every one: never tried again.
            self._wanted.pop(digest, None)
            self._settle(digest, reason)
            if proc.dead:
                return
        self._release(proc)

    def _settle(self, digest: str, outcome: str | None) -> None:
        future = self._outcomes.get(digest)
        if future is not None and not future.done():
            future.set_result(outcome)

    # --- processes ----------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._closed or time.monotonic() - self._spawn_failed_at < _RESPAWN_PAUSE_S:
            return
        for slot, proc in enumerate(self._procs):
            if proc is None and slot not in self._starting:
                self._starting.add(slot)
                self._spawn_task(self._start(slot))

    async def _start(self, slot: int) -> None:
        path = os.environ.get("PYTHONPATH")
        env = {
            **os.environ,
            "PYTHONPATH": _ROOT if not path else f"{_ROOT}{os.pathsep}{path}",
            # One text at a time: rayon's threads would only add address space.
            "TOKENIZERS_PARALLELISM": "false",
        }
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "llmgw.tokenizing.worker",
                str(self._memory_base),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
        except OSError as exc:
            self._spawn_failed_at = time.monotonic()
            log.warning("tokenize_worker_start_failed", pool=self._name, error=repr(exc))
            return
        finally:
            self._starting.discard(slot)
        proc = _Proc(process, slot)
        if self._closed:
            self._kill(proc)
            return
        self._procs[slot] = proc
        self._spawn_task(self._drain_stderr(proc))
        self._release(proc)

    async def _drain_stderr(self, proc: _Proc) -> None:
        # Kept, not logged: a Rust panic writes its message there, and the reply carries it.
        stream = proc.proc.stderr
        assert stream is not None
        while chunk := await stream.read(65536):
            proc.stderr += chunk
            del proc.stderr[:-_STDERR_TAIL]
        # Its stderr closed: it exited. One that died idle (the OOM killer, a signal) is
        # replaced now, not found dead by the next call (a busy one's exchange says so).
        if not proc.busy and not proc.dead:
            self.crashes += 1
            self._replace(proc, "it exited while idle")

    def _replace(self, proc: _Proc, why: str) -> None:
        if proc.dead:
            return
        proc.dead = True
        self._kill(proc)
        if self._procs[proc.slot] is proc:
            self._procs[proc.slot] = None
        log.warning(
            "tokenize_worker_replaced",
            pool=self._name,
            why=why,
            stderr=bytes(proc.stderr[-500:]).decode("utf-8", "replace"),
        )
        self._ensure_started()

    def _kill(self, proc: _Proc) -> None:
        with contextlib.suppress(ProcessLookupError):
            if proc.proc.returncode is None:
                proc.proc.kill()
        if not self._closed:
            self._spawn_task(proc.proc.wait())  # reaped off the caller's path

    def _spawn_task(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def pids(self) -> list[int]:
        return [p.proc.pid for p in self._procs if p is not None and not p.dead]

    def close(self) -> None:
        """Kill every worker (a call in flight answers "crashed" or is cancelled)."""
        self._closed = True
        for proc in self._procs:
            if proc is not None:
                proc.dead = True
                self._kill(proc)
                # Closed now, not when the loop collects it: a caller may close the loop next
                # (asyncio's Process has no public close; its transport does).
                transport = getattr(proc.proc, "_transport", None)
                if transport is not None:
                    transport.close()
        self._procs = [None] * self._size
        for _, waiter in self._waiters:
            waiter.cancel()
        self._waiters.clear()
        for task in list(self._tasks):
            task.cancel()

    async def aclose(self) -> None:
        procs = [p for p in self._procs if p is not None]
        self.close()
        for proc in procs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.proc.wait(), 5.0)
