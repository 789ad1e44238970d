"""The `e2e` guard (tests/support/e2e_guard.py) can fail: each of its two checks, run in a
session of its own (pytester), refuses an unmarked test that starts a process and passes a
marked one."""

from __future__ import annotations

import pytest

_GUARD = (
    "-p",
    "tests.support.e2e_guard",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:xdist",
    "-p",
    "no:asyncio",
)

_SPAWNING_FIXTURE = """
import pytest
from tests.support.e2e_guard import spawns_processes

@pytest.fixture
@spawns_processes
def fleet():
    yield
"""


def test_collection_refuses_an_unmarked_test_using_a_spawning_fixture(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(_SPAWNING_FIXTURE)
    pytester.makepyfile(
        """
        import pytest

        def test_unmarked(fleet):
            pass

        @pytest.mark.e2e
        def test_marked(fleet):
            pass
        """
    )
    result = pytester.runpytest_inprocess(*_GUARD)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*not marked `e2e`*", "*test_unmarked (fixture fleet)*"])
    assert "test_marked" not in result.stderr.str()


def test_collection_passes_marked_tests(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(_SPAWNING_FIXTURE)
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.e2e

        def test_marked(fleet):
            pass
        """
    )
    pytester.runpytest_inprocess(*_GUARD).assert_outcomes(passed=1)


@pytest.mark.e2e  # its inner tests start processes
def test_a_process_started_by_an_unmarked_test_fails_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os
        import subprocess
        import pytest

        def test_unmarked():
            subprocess.run(["true"], check=True)

        @pytest.mark.e2e
        def test_marked():
            subprocess.run(["true"], check=True)

        def test_postgres_programs_are_not_counted(tmp_path):
            initdb = tmp_path / "initdb"
            initdb.write_text("#!/bin/sh")
            initdb.chmod(0o755)
            # preexec_fn: Popen's own fork runs the at-fork hooks, and is still Popen's.
            subprocess.run([str(initdb)], check=True, preexec_fn=lambda: None)

        def test_forks():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)

        def test_quiet():
            pass
        """
    )
    result = pytester.runpytest_inprocess(*_GUARD)
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_unmarked starts processes but is not marked `e2e`*",
            "*test_forks starts processes but is not marked `e2e`*",
        ]
    )
