"""Real engines, run for real: llama.cpp's llama-server on a generated GGUF.

The binary: ``LLMGW_LLAMA_SERVER`` when set (.ci/run builds it first and sets it), else what
scripts/build-llama-server.sh prints. When a run collects a test that needs llama-server and
the variable is unset, the script runs once after collection (under pytest-xdist: once, in the
controller, before the workers start; tests/support/llama_build.py), before any test (outside
every test's timeout), its progress lines shown as they come: the first build takes ~7.5 minutes on 2
cores, a cached one answers at once. A build that cannot be made (no compiler, no cmake, no
package registry) skips these tests with the script's own words as the reason, which pytest's
summary (-ra) prints: never silently. ``pytest -m real_engine`` runs exactly these tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import may_run_real_engines
from tests.support.llama_build import build_llama_server
from tests.support.tiny_gguf import write_tiny_gguf

_BUILT = pytest.StashKey[tuple[str, str]]()  # (binary path or "", why not)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Only when a collected test runs llama-server: vLLM's publisher tests need no build.
    if may_run_real_engines(session.config) and any(
        "llama_server" in getattr(item, "fixturenames", ()) for item in session.items
    ):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        say = reporter.write_line if reporter is not None else (lambda _line: None)
        session.config.stash[_BUILT] = build_llama_server(say)


@pytest.fixture(scope="session")
def llama_server(request: pytest.FixtureRequest) -> str:
    binary, why_not = request.config.stash.get(
        _BUILT, ("", "not built: no collected test needed it")
    )
    if not binary:
        pytest.skip(why_not)
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} (LLMGW_LLAMA_SERVER or the build's output) is not executable")
    return binary


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("tiny-model") / "tiny.gguf"
    yield write_tiny_gguf(path)
