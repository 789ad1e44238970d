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
