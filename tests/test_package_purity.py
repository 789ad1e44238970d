"""The pure cores import no I/O: engines and kv are usable, and tested, without sockets, databases or processes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "llmgw"
PURE_PACKAGES = ["engines", "kv"]
FORBIDDEN = {
    "sqlalchemy", "psycopg", "httpx", "aiohttp", "zmq", "asyncio", "fastapi", "starlette",
    "uvicorn", "subprocess", "socket", "threading", "multiprocessing", "pynvml", "requests",
    "llmgw.controlplane", "llmgw.nodeagent", "llmgw.simengine",
}  # fmt: skip
# The other packages of llmgw a pure package may use: leaves with no I/O of their own.
ALLOWED_LLMGW = {"llmgw.errors"}


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _reads_environment(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "environb")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            return True
    return False


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_import_no_io(package: str) -> None:
    offenders: list[str] = []
    for path in _modules(package):
        for name in _imports(path):
            top = name.split(".")[0]
            if (
                name in FORBIDDEN
                or top in FORBIDDEN
                or any(name.startswith(f + ".") for f in FORBIDDEN)
            ):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
            elif (
                top == "llmgw"
                and not name.startswith(f"llmgw.{package}")
                and name not in ALLOWED_LLMGW
            ):
                offenders.append(f"{path.relative_to(ROOT)} imports {name} (another llmgw package)")
        if _reads_environment(path):
            offenders.append(f"{path.relative_to(ROOT)} reads os.environ")
    assert _modules(package), f"llmgw/{package} has no modules"
    assert offenders == []


# The reconciler's pure core (placement, the plan) shares its package with its I/O shell
# (leader.py, the loop), so it is listed module by module. It may use llmgw.engines, whose
# placement requirements state what a profile needs.
RECONCILE_PURE = [
    "__init__", "actions", "apply", "capacity", "placement", "plan", "replicas", "rollout",
    "snapshot", "status",
]  # fmt: skip


@pytest.mark.parametrize("module", RECONCILE_PURE)
def test_reconcile_core_imports_no_io(module: str) -> None:
    path = ROOT / "controlplane" / "planner" / f"{module}.py"
    offenders: list[str] = []
    for name in _imports(path):
        prefix, _, leaf = name.rpartition(".")
        if (prefix == "llmgw.controlplane.planner" and leaf in RECONCILE_PURE) or (
            name == "llmgw.engines" or name.startswith("llmgw.engines.") or name in ALLOWED_LLMGW
        ):
            continue
        top = name.split(".")[0]
        if top == "llmgw" or top in FORBIDDEN or any(name.startswith(f + ".") for f in FORBIDDEN):
            offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    if _reads_environment(path):
        offenders.append(f"{path.relative_to(ROOT)} reads os.environ")
    assert offenders == []


# The gateway's router core (issue #11) shares its package with the request path's I/O shell
# (app, upstream, routes): listed module by module. It may use llmgw.kv (hashing, the index).
GATEWAY_PURE = ["approx", "router"]


@pytest.mark.parametrize("module", GATEWAY_PURE)
def test_gateway_router_core_imports_no_io(module: str) -> None:
    path = ROOT / "controlplane" / "gateway" / f"{module}.py"
    offenders: list[str] = []
    for name in _imports(path):
        prefix, _, leaf = name.rpartition(".")
        if (prefix == "llmgw.controlplane.gateway" and leaf in GATEWAY_PURE) or (
            name == "llmgw.kv" or name.startswith("llmgw.kv.") or name in ALLOWED_LLMGW
        ):
            continue
        top = name.split(".")[0]
        if top == "llmgw" or top in FORBIDDEN or any(name.startswith(f + ".") for f in FORBIDDEN):
            offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    if _reads_environment(path):
        offenders.append(f"{path.relative_to(ROOT)} reads os.environ")
    assert offenders == []


def test_the_check_catches_an_offender(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport zmq\nx = os.environ['A']\n")
    assert "zmq" in _imports(bad)
    assert _reads_environment(bad)
