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

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression  # pytest's own -m parser
from hypothesis import HealthCheck, settings

from llmgw.embedded_postgres import throwaway_parent
from tests.pg_harness import PgServer, migrated_template, pg_server_session
from tests.support.llama_build import UNBUILT_ENV, build_llama_server

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
    # Under pytest-xdist the controller builds llama-server once, before the workers start, when
    # the run may reach the real-engine tests; the workers inherit the path (or why not) through
    # the environment (tests/support/llama_build.py). A worker, or a run without workers, builds
    # after its own collection (tests/real_engines/conftest.py).
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    if os.environ.get("LLMGW_LLAMA_SERVER") or not any(
        _reaches(arg, _REAL_ENGINES) for arg in config.args
    ):
        return
    if not may_run_real_engines(config):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    binary, why_not = build_llama_server(
        reporter.write_line if reporter is not None else (lambda _line: None)
    )
    if binary:
        os.environ["LLMGW_LLAMA_SERVER"] = binary
    else:
        os.environ[UNBUILT_ENV] = why_not


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


@pytest.fixture
def pg_tmp_path() -> Iterator[Path]:
    # pytest's tmp_path sits under a 0700 dir owned by root, which the `postgres` user a root
    # run starts the server as cannot enter: initdb would fail with "permission denied".
    # In RAM where there is room: initdb is three times faster there.
    path = Path(tempfile.mkdtemp(prefix="llmgw-test-", dir=throwaway_parent()))
    path.chmod(stat.S_IRWXU | stat.S_IXGRP | stat.S_IXOTH)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
