"""The event loop a long-running llmgw process runs on: uvloop where it is installed, as
uvicorn picks when it owns the loop, else asyncio's own.

The control plane serves its two listeners from one loop it starts itself, so uvicorn's
choice never applies to it. On asyncio's loop the gateway spent ~40% of its CPU in the
loop and its socket transports; uvloop's are compiled (bench/gateway.py).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from llmgw.logs import get_logger

__all__ = ["cancel_and_wait", "freeze_heap", "run", "wait_event"]

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop when available."""
    try:
        import uvloop
    except ImportError:  # Windows, or a build without it: asyncio's loop works, only slower
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def freeze_heap() -> None:
    """Leave what is alive now (modules, apps, caches built at start) out of every later
    garbage collection.

    Call once a server has started. A full collection walks every container object of the
    process: ~220k of them in a control plane, which stalled its loop for ~270 ms on this
    machine, a p99 of 250 ms at 32 clients through the gateway (bench/gateway.py). Frozen,
    they are never walked again; what requests allocate is collected as before.
    """
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    get_logger("llmgw").info(
        "heap_frozen",
        objects=gc.get_freeze_count(),
        ms=round((time.perf_counter() - start) * 1000, 1),
    )


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s``; whether it was set.

    ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11, ``wait_for`` loses a
    cancellation that arrives as the event is set (CPython gh-86296), and a loop stopped by
    ``cancel()`` then never stops. A route cache woken by a NOTIFY at the moment the gateway
    shut down hung its shutdown this way (found by tests/gateway/test_gateway_routes.py).
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_and_wait(
    tasks: asyncio.Task[Any] | Iterable[asyncio.Task[Any] | None] | None,
) -> None:
    """Cancel ``tasks`` (one, or several; None entries are skipped) and wait until each has
    finished, the one way every long-running loop of llmgw is stopped.

    ``asyncio.wait`` rather than ``with suppress(CancelledError): await task``: the latter
    also swallows a cancellation of the *caller* that arrives while it waits, and a shutdown
    that was itself cancelled would carry on as if it had not been. A task that failed with
    an error of its own while stopping is logged, not raised: one loop's crash must not keep
    the others from being stopped.
    """
    if tasks is None:
        return
    pending = [tasks] if isinstance(tasks, asyncio.Task) else [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    if not pending:
        return
    await asyncio.wait(pending)
    for task in pending:
        if not task.cancelled() and (exc := task.exception()) is not None:
            get_logger("llmgw").warning(
                "task_failed_while_stopping", task=task.get_name(), error=repr(exc)[:500]
            )
