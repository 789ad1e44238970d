"""The simulator's core (scheduler, cache, sampling, tokenizer, control, timing) does no I/O.

It is the part with the interesting logic, so it must stay unit-testable without sockets or an
event loop: only the shell modules (engine, publisher, http_app, server) may import those.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "llmgw" / "simengine"
CORE = ["block_pool", "chat_template", "control", "sampling", "scheduler", "timing", "tokenizer"]
FORBIDDEN_TOP = {
    "asyncio", "zmq", "fastapi", "starlette", "uvicorn", "httpx", "aiohttp", "socket",
    "subprocess", "threading", "multiprocessing", "prometheus_client", "time", "os",
}  # fmt: skip
ALLOWED_LLMGW = {"llmgw.errors", "llmgw.kv.events", "llmgw.kv.hashing"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_io(module: str) -> None:
    offenders = []
    for name in _imports(PACKAGE / f"{module}.py"):
        if name.split(".")[0] in FORBIDDEN_TOP or (
            name.startswith("llmgw.")
            and name not in ALLOWED_LLMGW
            and name.removeprefix("llmgw.simengine.") not in CORE
        ):
            offenders.append(name)
    assert offenders == []
