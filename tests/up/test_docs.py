"""docs/ kept true to the code: the admin API reference and the metrics table are generated
and must be current; every metric the prose, the dashboard or the runbook names exists."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llmgw_docs_generate", DOCS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _exposed_names() -> set[str]:
    names = set()
    for m in _generator().registered_metrics():
        names.add(m.name)
        if m.kind == "histogram":
            names |= {m.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def test_admin_api_reference_is_generated_from_the_current_openapi_document() -> None:
    gen = _generator()
    current = (DOCS / "admin-api.md").read_text()
    assert current == gen.admin_api_markdown(), (
        "docs/admin-api.md is stale: run .venv/bin/python docs/generate.py"
    )
    # Every route the app serves is in it.
    for path in gen._openapi()["paths"]:
        assert f" {path}`" in current, path


def test_metrics_table_lists_every_registered_metric() -> None:
    gen = _generator()
    text = (DOCS / "metrics.md").read_text()
    table = text.split(gen.BEGIN, 1)[1].split(gen.END, 1)[0].strip()
    assert table == gen.metrics_table(), (
        "the table in docs/metrics.md is stale: run .venv/bin/python docs/generate.py"
    )
    registered = {m.name for m in gen.registered_metrics()}
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.MULTILINE))
    assert listed == registered
    # The scan finds each process's metrics, not only some of them.
    for expected in (
        "llmgw_prefix_decisions_total",
        "llmgw_reconcile_leader",
        "llmgw_agent_shards",
        "llmgw_agent_kv_partial",
        "vllm:num_requests_running",
    ):
        assert expected in registered


def _names_in(text: str) -> set[str]:
    names = set(re.findall(r"\b(llmgw_[a-z0-9_]+|vllm:[a-z0-9_]+)", text))
    # API keys (llmgw_<16 hex>_<secret>) look like metric names; they are not.
    return {n for n in names if not re.match(r"llmgw_[0-9a-f]{16}_", n)}


def test_every_metric_the_docs_and_the_dashboard_name_exists() -> None:
    exposed = _exposed_names()
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = " ".join(
        t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]
    )
    assert _names_in(exprs), "the dashboard queries no metric"
    for where, text in (
        ("grafana-dashboard.json", exprs),
        ("metrics.md", (DOCS / "metrics.md").read_text()),
        ("runbook.md", (DOCS / "runbook.md").read_text()),
        ("README.md", (ROOT / "README.md").read_text()),
    ):
        unknown = _names_in(text) - exposed
        assert not unknown, f"{where} names metrics no code registers: {sorted(unknown)}"


# --- the README as a newcomer follows it ---------------------------------------------------------

RUN = "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/llmgw up"
TEST = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && .venv/bin/pytest"
_SHELL_LANGS = frozenset({"sh", "bash", "shell", "console"})
_ACTIVATE = re.compile(r"^\s*(?:\.|source)\s+\S*\.venv/bin/activate\s*(?:#.*)?$")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
# Where one command of a shell line ends and the next begins.
_SEPARATORS = re.compile(r"&&|\|\||[;|`]|\$\(")
_WRAPPERS = frozenset({"sudo", "env", "exec", "time", "nohup"})


def _fenced(text: str) -> list[tuple[str, list[str], int]]:
    """Every top-level fenced block: (language, lines, line number of its opening fence)."""
    blocks: list[tuple[str, list[str], int]] = []
    lang: str | None = None
    body: list[str] = []
    start = 0
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, body, start = line[3:].strip().lower(), [], no
            else:
                blocks.append((lang, body, start))
                lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"a fence opened on line {start} is never closed"
    return blocks


def _commands(line: str) -> list[list[str]]:
    """The words of each command on a shell line, comments and leading assignments dropped."""
    code = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]
    out = []
    for part in _SEPARATORS.split(code):
        words = part.split()
        while words and (re.match(r"^\w+=", words[0]) or words[0] in _WRAPPERS):
            words = words[1:]
        if words:
            out.append(words)
    return out


def _shell_problems(lang: str, lines: list[str], start: int) -> list[str]:
    """What in one shell block a newcomer's shell (no virtual environment on its PATH) fails:
    a bare `llmgw` (the install puts it in .venv/bin only) or the system's Python, unless an
    earlier line of the block activates the environment."""
    problems: list[str] = []
    activated = False
    heredoc_end: str | None = None
    for offset, line in enumerate(lines, 1):
        where = f"line {start + offset}: {line.strip()!r}"
        if heredoc_end is not None:
            heredoc_end = None if line.strip() == heredoc_end else heredoc_end
            continue
        if _ACTIVATE.match(line):
            activated = True
            continue
        for words in _commands(line):
            program = words[0]
            if program == "llmgw" and not activated:
                problems.append(
                    f"{where}: `llmgw` is not on a newcomer's PATH; write .venv/bin/llmgw or "
                    "put `. .venv/bin/activate` on an earlier line of the block"
                )
            elif program.endswith("/llmgw") and not program.endswith(".venv/bin/llmgw"):
                problems.append(f"{where}: {program} is not the virtual environment's llmgw")
            elif (
                program in ("python", "python3") and not activated and words[1:3] != ["-m", "venv"]
            ):
                problems.append(
                    f"{where}: `{program}` is the system's Python (no llmgw, no openai); write "
                    ".venv/bin/python or activate the environment first"
                )
        if m := _HEREDOC.search(line):
            heredoc_end = m.group(2)
    return problems


def test_the_readme_opens_with_its_two_commands_exactly() -> None:
    blocks = _fenced((ROOT / "README.md").read_text())
    assert [(lang, body) for lang, body, _ in blocks[:2]] == [("sh", [RUN]), ("sh", [TEST])]


def test_every_shell_example_runs_in_a_newcomers_shell() -> None:
    """Each fenced shell block of the README and docs/ calls llmgw and Python as a shell without
    the virtual environment on its PATH can: by .venv/bin paths, or after activating it."""
    problems = []
    shell_blocks = 0
    for path in (ROOT / "README.md", *sorted(DOCS.glob("*.md"))):
        for lang, lines, start in _fenced(path.read_text()):
            if lang in _SHELL_LANGS:
                shell_blocks += 1
                rel = path.relative_to(ROOT)
                problems += [f"{rel} {p}" for p in _shell_problems(lang, lines, start)]
    assert shell_blocks >= 5, "the scan found too few shell blocks to mean anything"
    assert not problems, "\n".join(problems)


def test_the_checker_catches_the_newcomer_traps() -> None:
    """The rules above, on the examples a newcomer tripped over."""
    assert _shell_problems("sh", ["llmgw status"], 0)
    assert _shell_problems("sh", ["sleep 1 && llmgw get nodes   # then look"], 0)
    assert _shell_problems("sh", ["python3 - <<'PY'", "import openai", "PY"], 0)
    assert _shell_problems("sh", ["/usr/local/bin/llmgw status"], 0)
    assert not _shell_problems("sh", [". .venv/bin/activate", "llmgw status"], 0)
    assert not _shell_problems("sh", [".venv/bin/llmgw status  # llmgw status"], 0)
    assert not _shell_problems("sh", [RUN, TEST], 0)
    # A heredoc's body is the program's input, not shell.
    assert not _shell_problems("sh", [".venv/bin/python - <<'PY'", "llmgw = 1", "PY"], 0)


def test_the_openai_example_runs_with_the_venvs_python_and_its_client() -> None:
    """The openai client is not in the plain install and not in the system's Python: an
    example that imports it runs with the environment's interpreter, which the same block
    gives the client (or the dev extra, which the block names, has it)."""
    found = 0
    for lang, lines, start in _fenced((ROOT / "README.md").read_text()):
        body = "\n".join(lines)
        if not re.search(r"^\s*(from openai import|import openai)", body, flags=re.MULTILINE):
            continue
        found += 1
        where = f"README.md line {start}"
        assert lang in _SHELL_LANGS, (
            f"{where}: a bare {lang or 'unlabelled'} block; a newcomer runs it with python3, "
            "the system's, which has no openai: make it a shell block run by .venv/bin/python"
        )
        assert re.search(r"(^|\s)\.venv/bin/python3? - <<", body, flags=re.MULTILINE), (
            f"{where}: the example must be run by .venv/bin/python"
        )
        assert re.search(r"\.venv/bin/pip install (-\S+ )*openai", body), (
            f"{where}: say how the client gets into .venv (.venv/bin/pip install openai)"
        )
        assert "[dev]" in body, f"{where}: say that the dev extra has the client already"
    assert found, "the README shows no openai example"


# --- links and citations stay inside the repository ------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_MD_PATH = re.compile(r"(?<![\w/.:-])((?:\.{1,2}/)*[\w.-]+(?:/[\w.-]+)*\.md)\b")
_ARCH_SECTION = re.compile(r"architecture\.md §(\d+)")


def _doc_files() -> list[Path]:
    config = sorted(p for p in (ROOT / "config").rglob("*") if p.is_file())
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *config]


def _inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def _citation_problems(rel: str, text: str, base: Path) -> list[str]:
    """Links to paths outside the repository and documents cited that it does not have."""
    problems = []
    for target in _LINK.findall(text):
        if re.match(r"^(https?|mailto):", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if target.startswith("/") or re.match(r"^\w+:", target):
            problems.append(f"{rel}: links {target}, outside the repository; link a relative path")
        elif not _inside(base / path):
            problems.append(f"{rel}: links {target}, outside the repository")
        elif not (base / path).exists():
            problems.append(f"{rel}: links {target}, which the repository does not have")
    if re.search(r"file://", text):
        problems.append(f"{rel}: a file:// URI names a path on one machine")
    for cited in _MD_PATH.findall(text):
        candidates = (base / cited, ROOT / cited)
        if not any(_inside(c) and c.exists() for c in candidates):
            problems.append(f"{rel}: cites {cited}, which the repository does not have")
    if m := re.search(r"\bdesign(?:\.md)? §\d+", text):
        problems.append(f"{rel}: cites {m.group(0)!r}; the design is docs/architecture.md")
    return problems


def test_docs_and_config_link_only_inside_the_repository() -> None:
    problems = []
    for path in _doc_files():
        text = path.read_text(errors="replace")
        problems += _citation_problems(str(path.relative_to(ROOT)), text, path.parent)
    assert not problems, "\n".join(problems)


def test_the_citation_checker_catches_what_a_newcomer_hit() -> None:
    base = ROOT
    assert _citation_problems("x", "[design.md](/work/shared/design.md)", base)
    assert _citation_problems("x", "see [it](../shared/design.md)", base)
    assert _citation_problems("x", "(design §6)", base)
    assert _citation_problems("x", "Documentation=file:///usr/share/doc/llmgw/design.md", base)
    assert _citation_problems("x", "[gone](docs/no-such-page.md)", base)
    assert not _citation_problems("x", "[arch](docs/architecture.md), https://x.org/a.md", base)


def test_every_architecture_section_cited_exists() -> None:
    """`docs/architecture.md §N`, wherever the repository says it (docstrings included), names
    a section the page has."""
    sections = set(re.findall(r"^## (\d+)\. ", (DOCS / "architecture.md").read_text(), re.M))
    assert {str(n) for n in range(1, 11)} <= sections
    cited: dict[str, set[str]] = {}
    sources = [*_doc_files(), *sorted((ROOT / "llmgw").rglob("*.py"))]
    sources += sorted((ROOT / "tests").rglob("*.py"))
    for path in sources:
        for n in _ARCH_SECTION.findall(path.read_text(errors="replace")):
            cited.setdefault(n, set()).add(str(path.relative_to(ROOT)))
    missing = {n: sorted(where) for n, where in cited.items() if n not in sections}
    assert not missing, f"cited sections docs/architecture.md does not have: {missing}"
    assert cited, "nothing cites docs/architecture.md by section"
