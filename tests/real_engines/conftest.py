"""Real engines, run for real: llama.cpp's llama-server on a generated GGUF.

The binary: ``LLMGW_LLAMA_SERVER`` when set (.ci/run builds it first and sets it), else what
scripts/build-llama-server.sh prints. When a run collects a test that needs llama-server and
the variable is unset, the script runs once after collection, before any test (outside every test's
timeout), its progress lines shown as they come: the first build takes ~7.5 minutes on 2
cores, a cached one answers at once. A build that cannot be made (no compiler, no cmake, no
package registry) skips these tests with the script's own words as the reason, which pytest's
summary (-ra) prints: never silently. ``pytest -m real_engine`` runs exactly these tests.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.tiny_gguf import write_tiny_gguf

_ROOT = Path(__file__).resolve().parents[2]
_BUILD = _ROOT / "scripts" / "build-llama-server.sh"
_BUILD_TIMEOUT_S = 1800
_BUILT = pytest.StashKey[tuple[str, str]]()  # (binary path or "", why not)


def _build(session: pytest.Session) -> tuple[str, str]:
    given = os.environ.get("LLMGW_LLAMA_SERVER", "")
    if given:
        return given, ""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line)

    say(f"real-engine tests: {_BUILD.relative_to(_ROOT)} (cached after the first build)")
    proc = subprocess.Popen(
        ["bash", str(_BUILD)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None and proc.stdout is not None
    last = "no output"
    for line in proc.stderr:
        last = line.rstrip() or last
        say(f"  {last}")
    try:
        out = proc.stdout.read().strip().splitlines()
        code = proc.wait(timeout=_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "", f"{_BUILD.name} took over {_BUILD_TIMEOUT_S} s"
    if code != 0 or not out:
        return "", f"llama-server could not be built ({_BUILD.name}): {last}"
    return out[-1], ""


def pytest_collection_finish(session: pytest.Session) -> None:
    # Only when a collected test runs llama-server: vLLM's publisher tests need no build.
    if any("llama_server" in getattr(item, "fixturenames", ()) for item in session.items):
        session.config.stash[_BUILT] = _build(session)


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
