"""The suite's one way to wait for a condition: poll it until it holds, fail naming what was
awaited at the deadline. ``wait_for`` for plain code, ``until`` inside a test's event loop
(its condition may be sync or async).

The condition's answer: something truthy means done (and is returned); falsy means not yet.
An AssertionError from it means never (a process under test exited, say) and fails at once;
any other exception means not yet (a server still starting), the last one quoted at the
deadline. Polling is what these tests check: a process's state, a table, a log, none of which
has an event to wait on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["WaitTimeout", "until", "wait_for"]

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition did not hold by the deadline (a caller may add what it knows)."""


def _timed_out(timeout_s: float, what: str, last_exc: BaseException | None) -> WaitTimeout:
    why = f" (last error: {last_exc!r})" if last_exc is not None else ""
    return WaitTimeout(f"timed out after {timeout_s}s waiting for {what}{why}")


def wait_for(
    condition: Callable[[], T | None], *, timeout_s: float, what: str, interval_s: float = 0.05
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except AssertionError:
            raise
        except Exception as exc:  # the condition may fail until it holds
            last_exc = exc
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what, last_exc)
        time.sleep(interval_s)


async def until(
    condition: Callable[[], T | Awaitable[T | None] | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.02,
) -> T:
    """``wait_for`` without blocking the event loop; ``condition`` may return an awaitable."""
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while True:
        try:
            value: Any = condition()
            if asyncio.iscoroutine(value) or isinstance(value, Awaitable):
                value = await value
            if value:
                return value  # type: ignore[no-any-return]
        except AssertionError:
            raise
        except Exception as exc:  # the condition may fail until it holds
            last_exc = exc
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what, last_exc)
        await asyncio.sleep(interval_s)
