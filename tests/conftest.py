"""Fixtures every test directory shares: real Postgres databases and the hypothesis profile.

Database fixtures (see tests/pg_harness.py for how they are made):

    pg_server      session   the PgServer: admin URL, create/drop databases on it
    db_url         function  a fresh database at the migrations' head, dropped afterwards
    empty_db_url   function  a fresh database with no schema, for migration tests
    pg_tmp_path    function  a temp dir the `postgres` user can enter (tmp_path is 0700)

No test reaches the database unless it asks for one of these, so a test run without Postgres
binaries fails only the tests that need it, each with the install hint.

Hypothesis: profile "ci" (CI=true) is derandomised, keeps no example database and suppresses the
too-slow health check, since on 2 shared cores timing says nothing; "dev" only drops deadlines.
HYPOTHESIS_PROFILE overrides the choice. This module must not start servers at import.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _pytest.mark.expression import Expression  # pytest's own -m parser
from hypothesis import HealthCheck, settings

from llmgw.embedded_postgres import throwaway_parent
from tests.pg_harness import PgServer, migrated_template, pg_server_session
from tests.support.engine_builds import SETUPS, run_setup

# The `e2e` mark enforced on every test that starts a process (see that module's docstring);
# pytester runs the guard's own tests (tests/support/test_e2e_guard.py).
pytest_plugins = ["tests.support.e2e_guard", "pytester"]

settings.register_profile("dev", deadline=None)
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE")
    or ("ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev")
)


_REAL_ENGINES = Path(__file__).resolve().parent / "real_engines"


@pytest.hookimpl(trylast=True)  # after the terminal reporter is there to print the progress
def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist the controller sets up the real engines once (builds llama-server,
    # installs vLLM for the CPU), before the workers start, when the run may reach the
    # real-engine tests; the workers inherit each result (or why not) through the environment
    # (tests/support/engine_builds.py). A worker, or a run without workers, sets up after its
    # own collection (tests/real_engines/conftest.py).
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    if not any(_reaches(arg, _REAL_ENGINES) for arg in config.args):
        return
    if not may_run_real_engines(config):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    for setup in SETUPS:
        if os.environ.get(setup.env):
            continue
        result, why_not = run_setup(
            setup, reporter.write_line if reporter is not None else (lambda _line: None)
        )
        if result:
            os.environ[setup.env] = result
        else:
            os.environ[setup.unbuilt_env] = why_not


# Test files whose tests share long-lived setups (module-scoped fixtures starting `llmgw up`,
# control planes, engines), each run whole on one pytest-xdist worker: split over two workers,
# each worker starts the module's setup again (the vLLM module's `llmgw up` with two vLLM
# replicas takes minutes; an `llmgw up` or a control plane seconds), and tests that build on
# the state an earlier test of their module left would see a fresh setup instead.
# pytest-xdist's own `--dist loadgroup` does not work with pytest 9 (it renames nodeids
# through an attribute pytest no longer reads), so the scheduler below groups by file: a
# grouped file is one work unit of several tests and every other test its own, and xdist hands
# out the units with the most tests first.
_GROUPED_FILES = ("tests/real_engines/test_vllm_up.py",)
_GROUPED_FOLDERS = (
    "tests/up/",
    "tests/real_engines/",
    "tests/controlplane/admin/",
    "tests/controlplane/console/",
    "tests/e2e/",
)


class _LongestFirst(OrderedDict[str, dict[str, bool]]):
    """xdist's work queue, with the groups of _GROUPED_FILES always at its front: xdist orders
    units by their number of tests, and the vLLM module, the longest by far in time, must start
    first or it is the run's tail on one worker while the other idles."""

    def __setitem__(self, key: str, value: dict[str, bool]) -> None:
        super().__setitem__(key, value)
        if key in _GROUPED_FILES:
            self.move_to_end(key, last=False)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class _FileGroups(LoadScopeScheduling):  # type: ignore[misc]
        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self.workqueue = _LongestFirst()

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path in _GROUPED_FILES or path.startswith(_GROUPED_FOLDERS):
                return path
            return nodeid

    return _FileGroups(config, log)


def may_run_real_engines(config: pytest.Config) -> bool:
    """False when this run can run no real-engine test whatever it collects: --collect-only,
    or a -m that a test marked `real_engine` and `e2e` does not match (the fast tier's
    ``-m "not e2e and not real_engine"``), so that neither builds llama-server for nothing."""
    if config.option.collectonly:
        return False
    markexpr = config.option.markexpr
    if not markexpr:
        return True
    marks = {"real_engine", "e2e"}
    return Expression.compile(markexpr).evaluate(lambda name, **_kw: name in marks)


def _reaches(arg: str, folder: Path) -> bool:
    path = Path(arg.split("::", 1)[0]).resolve()
    return path == folder or folder in path.parents or path in folder.parents


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    with pg_server_session() as server:
        yield server


@pytest.fixture(scope="session")
def _pg_template(pg_server: PgServer) -> Iterator[str]:
    with migrated_template(pg_server) as name:
        yield name


@pytest.fixture
def db_url(pg_server: PgServer, _pg_template: str) -> Iterator[str]:
    name = pg_server.new_name("db")
    url = pg_server.create_database(name, template=_pg_template)
    try:
        yield url
    finally:
        pg_server.drop_database(name)


@pytest.fixture
def empty_db_url(pg_server: PgServer) -> Iterator[str]:
    name = pg_server.new_name("empty")
    # template0 is pristine: template1 may carry whatever the server's admin put there.
    url = pg_server.create_database(name, template="template0")
    try:
        yield url
    finally:
        pg_server.drop_database(name)


@contextlib.contextmanager
def pg_dir() -> Iterator[Path]:
    """A temp dir the `postgres` user can enter, removed afterwards: pytest's tmp_path sits
    under a 0700 dir owned by root, which the `postgres` user a root run starts the server as
    cannot enter (initdb would fail with "permission denied"). In RAM where there is room:
    initdb is three times faster there. For a fixture of wider scope than pg_tmp_path."""
    path = Path(tempfile.mkdtemp(prefix="llmgw-test-", dir=throwaway_parent()))
    path.chmod(stat.S_IRWXU | stat.S_IXGRP | stat.S_IXOTH)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pg_tmp_path() -> Iterator[Path]:
    with pg_dir() as path:
        yield path
