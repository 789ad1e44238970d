"""The `e2e` mark, enforced: a test that starts a process carries it, so that
``pytest -m "not e2e and not real_engine"`` is the fast tier (README.md says how to run it).

What counts as starting a process: any child process a test (its body or any fixture it sets
up) starts, an `llmgw` command, an engine, a shell script, a browser, `pip`. What does not:
Postgres's own programs (``postgres``, ``initdb``, ...; see NOT_COUNTED). Every database test
reaches the one embedded Postgres the session starts for all of them (tests/conftest.py), and
a throwaway cluster is how the store's own tests run: that server is the suite's database, not
the system under test.

Two checks, as one rule:

- at collection: a test that uses a fixture marked with :func:`spawns_processes` (the control
  plane, the fleet, the simulator, agents) and lacks the mark fails the whole collection,
  naming the test and the fixture; cheap, and it fails before anything runs;
- at run time, the backstop: ``subprocess.Popen`` (under asyncio's subprocesses too) and
  ``os.fork`` (under multiprocessing's fork context) fail an unmarked test that starts a
  child, naming the command. A helper that spawns inside the test body is caught here,
  whatever it is called.

Loaded by tests/conftest.py (``pytest_plugins``).
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, TypeVar

import pytest

__all__ = ["E2E_MARK", "NOT_COUNTED", "spawns_processes"]

E2E_MARK = "e2e"

# The programs of a Postgres bin directory that llmgw.embedded_postgres runs, and fontconfig's
# fc-list, which matplotlib runs once per machine to build its font cache (not the test's
# doing, and only on a machine without the cache, so counting it would make the check flaky).
NOT_COUNTED = frozenset(
    {"postgres", "initdb", "pg_ctl", "pg_isready", "psql", "pg_dump", "pg_restore", "fc-list"}
)

_F = TypeVar("_F", bound=Callable[..., Any])
_SPAWNS_ATTR = "_llmgw_spawns_processes"


def spawns_processes(fixture_function: _F) -> _F:
    """Mark a fixture function (below its ``@pytest.fixture``) as one that starts processes:
    every test that uses it, directly or through another fixture, must carry `e2e`."""
    setattr(fixture_function, _SPAWNS_ATTR, True)
    return fixture_function


def _spawning_fixture(item: pytest.Item) -> str | None:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in item.fixturenames:  # type: ignore[attr-defined]
        fixturedefs = info.name2fixturedefs.get(name, ())
        # The last definition is the one this test gets (a closer conftest overrides).
        if fixturedefs and getattr(fixturedefs[-1].func, _SPAWNS_ATTR, False):
            return name
    return None


def _spawn_exempt(item: pytest.Item) -> bool:
    return item.get_closest_marker(E2E_MARK) is not None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: an unmarked test is wrong either way
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong: dict[str, set[str]] = {}  # test function (parameters folded) -> its fixtures
    for item in items:
        if not _spawn_exempt(item) and (fixture := _spawning_fixture(item)) is not None:
            wrong.setdefault(item.nodeid.split("[", 1)[0], set()).add(fixture)
    if wrong:
        raise pytest.UsageError(
            "these tests start processes but are not marked `e2e` "
            "(add pytest.mark.e2e to the test or its module's pytestmark; "
            "tests/support/e2e_guard.py):\n  "
            + "\n  ".join(f"{test} (fixture {', '.join(sorted(f))})" for test, f in wrong.items())
        )


# The test running now, in this process (any thread: a harness may spawn from a thread).
_running: pytest.Item | None = None
_spawned: list[str] = []
_lock = threading.Lock()
_original_execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]


def _argv(args: Any) -> list[str]:
    # Popen's args as it got them: a string (shell=True, or one program), bytes, a path, a list.
    if isinstance(args, str | bytes | os.PathLike):
        return os.fsdecode(args).split()
    return [os.fsdecode(a) for a in args]


# Set while this thread is inside Popen: its fork (one with a preexec_fn runs the at-fork
# hooks) is Popen's, counted or exempted there.
_in_popen = threading.local()


def _guarded_execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
    item = _running
    if item is not None and not _spawn_exempt(item):
        argv = _argv(args)
        if not argv or Path(argv[0]).name not in NOT_COUNTED:
            with _lock:
                _spawned.append(" ".join(argv)[:200])
    _in_popen.active = True
    try:
        _original_execute_child(self, args, *rest, **kw)
    finally:
        _in_popen.active = False


def _before_fork() -> None:
    # A child that is not exec'd by Popen: os.fork, multiprocessing's fork context (the gateway
    # process's workers, llmgw.serve.gateway_process).
    item = _running
    if item is not None and not _spawn_exempt(item) and not getattr(_in_popen, "active", False):
        with _lock:
            _spawned.append("os.fork() (multiprocessing, say)")


subprocess.Popen._execute_child = _guarded_execute_child  # type: ignore[attr-defined]
os.register_at_fork(before=_before_fork)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, Any, None]:
    global _running
    # The one before, restored after: a session run inside a test (tests/support/
    # test_e2e_guard.py's pytester) must hand the outer test back its guard.
    outer, _running = _running, item
    try:
        yield
    finally:
        _running = outer
        with _lock:
            _spawned.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    with _lock:
        spawned, _spawned[:] = list(_spawned), []
    if spawned and report.passed:
        # A module-scoped fixture's processes start in its first test's setup: that test fails.
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} starts processes but is not marked `e2e` "
            "(add pytest.mark.e2e to the test or its module's pytestmark; "
            "tests/support/e2e_guard.py):\n  " + "\n  ".join(spawned[:5])
        )
