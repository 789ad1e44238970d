"""The package is a pure core: no I/O module, nothing of the gateway's shell, no llmgw
package but the error tree (so docs/packages.md can mark it pure, beside the router)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_package_map import IO_IMPORTS

PACKAGE = Path(__file__).resolve().parents[3] / "llmgw" / "gateway" / "apis"


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_a_module_imports_nothing_that_does_io(path: Path) -> None:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    assert sorted(n for n in names if n.split(".")[0] in IO_IMPORTS) == []
    llmgw = {n for n in names if n.split(".")[0] == "llmgw"}
    assert (
        sorted(n for n in llmgw if n != "llmgw.errors" and not n.startswith("llmgw.gateway.apis."))
        == []
    )
    assert "os.environ" not in path.read_text()
