"""docs/packages.md is the map of llmgw's packages: what each holds and what it may import.
These tests hold the real imports to it, so the map cannot drift from the code, and hold the
modules it marks pure to having no I/O (one parametrised check instead of one per package).

The map's table rows read ``| `llmgw.x` | pure or blank | what it holds | `llmgw.a`, `llmgw.b` |``.
A module belongs to the most specific row naming it or a package above it; it may import
anything inside its own row's name and anything under a name its row allows. A module whose
docstring says ``Pure:`` must sit under a row marked pure.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "llmgw"
MAP = REPO / "docs" / "packages.md"

# What a pure module may not import: anything that does I/O, and the packages that do it.
IO_IMPORTS = {
    "sqlalchemy", "psycopg", "httpx", "aiohttp", "zmq", "asyncio", "fastapi", "starlette",
    "uvicorn", "subprocess", "socket", "threading", "multiprocessing", "pynvml", "requests",
    "apscheduler", "uvloop", "shutil", "tempfile", "select", "signal", "time", "os",
    "prometheus_client", "structlog", "urllib",
}  # fmt: skip


@dataclass(frozen=True)
class Row:
    name: str
    pure: bool
    allowed: tuple[str, ...]


_ROW = re.compile(r"^\|\s*`(llmgw[\w.]*)`\s*\|\s*(pure)?\s*\|[^|]*\|([^|]*)\|\s*$")


def _rows() -> dict[str, Row]:
    rows: dict[str, Row] = {}
    for line in MAP.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            name, pure, allowed = m.group(1), m.group(2) is not None, m.group(3)
            assert name not in rows, f"docs/packages.md names {name} twice"
            rows[name] = Row(name, pure, tuple(re.findall(r"`(llmgw[\w.]*)`", allowed)))
    return rows


def _module_name(path: Path) -> str:
    # A package's own __init__ keeps its name (llmgw.controlplane.__init__), so a row can name
    # it alone without vouching for every module below it.
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _row_of(module: str, rows: dict[str, Row]) -> Row | None:
    owners = [r for n, r in rows.items() if _under(module, n)]
    return max(owners, key=lambda r: len(r.name), default=None)


def _imports(path: Path) -> set[str]:
    """Every absolute import of the module, function-level (deferred) imports included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "llmgw":
                # `from llmgw.a import b`: b may be a module; _llmgw_imports resolves the name.
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                names.add(node.module)
    return names


def _llmgw_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The llmgw modules the module imports: each name resolved to the longest module it names
    (``from llmgw.a import name`` is llmgw.a.name when that is a module, else llmgw.a)."""
    found = set()
    for name in _imports(path):
        if name.split(".")[0] != "llmgw":
            continue
        while name and name not in modules and f"{name}.__init__" not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name if name in modules else f"{name}.__init__")
    return found


def _reads_environment(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "environb")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            return True
    return False


def _declares_pure(path: Path) -> bool:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return re.search(r"(?:^|\s)Pure:", doc) is not None


ROWS = _rows()
MODULES = _modules()


def test_the_map_names_only_real_packages_and_modules() -> None:
    assert ROWS, "docs/packages.md has no table rows"
    unknown = [n for n in ROWS if not any(_under(m, n) for m in MODULES)]
    assert unknown == []
    unknown_allowed = sorted(
        {a for r in ROWS.values() for a in r.allowed if not any(_under(m, a) for m in MODULES)}
    )
    assert unknown_allowed == []


def test_every_arrow_points_down_the_page() -> None:
    """A row may allow only rows below it: the table is the layering, and it has no cycle."""
    order = list(ROWS)
    upward = [
        f"{row.name} allows {allowed} ({owner.name} stands above it)"
        for row in ROWS.values()
        for allowed in row.allowed
        if (owner := _row_of(allowed, ROWS)) is not None
        and order.index(owner.name) <= order.index(row.name)
        and not _under(allowed, row.name)
    ]
    assert upward == []


def test_every_module_is_on_the_map() -> None:
    assert [m for m in MODULES if _row_of(m, ROWS) is None] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_map(module: str) -> None:
    row = _row_of(module, ROWS)
    assert row is not None
    offenders = [
        name
        for name in sorted(_llmgw_imports(MODULES[module], MODULES))
        if not _under(name, row.name) and not any(_under(name, a) for a in row.allowed)
    ]
    assert offenders == [], f"{module} ({row.name} in docs/packages.md) may not import these"


def _pure_or_logs(module: str) -> bool:
    # A pure core may log: a log line is no input, and testing it needs no socket or database.
    row = _row_of(module, ROWS)
    return module == "llmgw.logs" or (row is not None and row.pure)


PURE = sorted(m for m in MODULES if (r := _row_of(m, ROWS)) is not None and r.pure)


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_do_no_io(module: str) -> None:
    path = MODULES[module]
    offenders = sorted(name for name in _imports(path) if name.split(".")[0] in IO_IMPORTS)
    offenders += sorted(m for m in _llmgw_imports(path, MODULES) if not _pure_or_logs(m))
    if _reads_environment(path):
        offenders.append("os.environ")
    assert offenders == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_that_says_it_is_pure_is_checked(module: str) -> None:
    if _declares_pure(MODULES[module]):
        row = _row_of(module, ROWS)
        assert row is not None and row.pure, (
            f"{module} says 'Pure:' but docs/packages.md does not mark it (or its package) pure"
        )


def test_the_checks_catch_offenders(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('"""Pure: claims it."""\nimport os\nimport zmq\nx = os.environ["A"]\n')
    assert "zmq" in _imports(bad)
    assert _reads_environment(bad)
    assert _declares_pure(bad)
    rows = {"llmgw.a": Row("llmgw.a", True, ("llmgw.b",)), "llmgw.a.x": Row("llmgw.a.x", False, ())}
    assert _row_of("llmgw.a.__init__", rows) == rows["llmgw.a"]
    assert _row_of("llmgw.a.x.y", rows) == rows["llmgw.a.x"]
    assert _row_of("llmgw.a.z", rows) == rows["llmgw.a"]
    assert _row_of("llmgw.ab", rows) is None
