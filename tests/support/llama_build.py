"""Building llama-server for the real-engine tests: scripts/build-llama-server.sh run once, its
progress lines passed to ``say`` as they come (the first build takes ~7.5 minutes on 2 cores; a
cached one answers at once).

The binary is ``LLMGW_LLAMA_SERVER`` when set (.ci/run builds it first and sets it). Under
pytest-xdist the controller builds before its workers start and hands them the path in that
variable, or why there is none in ``LLMGW_LLAMA_SERVER_UNBUILT``: two workers building into one
cache at once would clobber each other, and a worker's output never reaches the terminal.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

__all__ = ["BUILD_SCRIPT", "UNBUILT_ENV", "build_llama_server"]

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-llama-server.sh"
UNBUILT_ENV = "LLMGW_LLAMA_SERVER_UNBUILT"
_BUILD_TIMEOUT_S = 1800


def build_llama_server(say: Callable[[str], None]) -> tuple[str, str]:
    """(the binary's path, "") or ("", why it could not be built)."""
    given = os.environ.get("LLMGW_LLAMA_SERVER", "")
    if given:
        return given, ""
    unbuilt = os.environ.get(UNBUILT_ENV, "")
    if unbuilt:
        return "", unbuilt
    say(f"real-engine tests: scripts/{BUILD_SCRIPT.name} (cached after the first build)")
    proc = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
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
        return "", f"{BUILD_SCRIPT.name} took over {_BUILD_TIMEOUT_S} s"
    if code != 0 or not out:
        return "", f"llama-server could not be built ({BUILD_SCRIPT.name}): {last}"
    return out[-1], ""
