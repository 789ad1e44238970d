"""The console's Adapters section (issue [lora] item 5): each declared adapter's base model,
bounds, desired / placed / loaded replicas (the figures of `llmgw status`), where it is held
(replica short id, node, loaded / loading / unloading / load failed with the engine's reason),
why it is short, failing loads under "needs attention", and the empty state; operator and
engine text escaped. The pure parts from crafted statuses; then over real HTTP against a real
`llmgw controlplane` whose reconcile loop is off (``cp``), so the leader's and agents' rows
the test plants stay as planted."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from html.parser import HTMLParser
from typing import Any

import httpx
import pytest

from llmgw.controlplane.console.fleet_view import (
    ADAPTER_HOLDINGS_SHOWN,
    AdapterRow,
    adapter_rows,
    attention,
)
from llmgw.controlplane.console.web import _env
from tests.controlplane.admin.admin_testkit import (
    ControlPlane,
    insert_node,
    insert_replica,
    name,
    sql,
)

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
# Engine text with markup in it: shown as text, never as markup.
EVIL = '<img src=x onerror=alert(1)> & "quoted" <script>alert(2)</script>'


def _item(adapter: str, status: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "name": adapter, "model": "base", "path": "/a", "min_replicas": None,
        "max_replicas": None, "pinned": False, "status": status, **extra,
    }  # fmt: skip


def _h(replica: str, node: str) -> dict[str, str]:
    return {"replica": replica, "node": node}


def _f(replica: str, node: str, reason: str, failures: int) -> dict[str, Any]:
    return {"replica": replica, "node": node, "reason": reason, "failures": failures}


# --- the pure parts --------------------------------------------------------------------


def test_a_row_counts_and_places_every_replica_its_status_names() -> None:
    status = {
        "desired_replicas": 3,
        "replicas": [_h("r1-aaaaaaaa", "n1"), _h("r2-bbbbbbbb", "n2"), _h("r3-cccccccc", "n3")],
        "loaded": [_h("r1-aaaaaaaa", "n1"), _h("r4-dddddddd", "n4")],
        "failures": [_f("r2-bbbbbbbb", "n2", "no such dir", 2)],
        "unplaced": "only 3 of the 4 replicas of model base that can hold it are ready",
    }
    [row] = adapter_rows([_item("sql", status, min_replicas=1, pinned=True)])
    assert (row.name, row.model, row.desired, row.placed, row.loaded, row.failing) == (
        "sql", "base", 3, 3, 2, 1,
    )  # fmt: skip
    assert (row.bounds, row.pinned) == ("1..–", True)
    # Failed first, then loading, unloading (loaded, no longer desired there), loaded.
    assert [(h.short, h.node, h.state) for h in row.holdings] == [
        ("r2-bbbbb", "n2", "failed"),
        ("r3-ccccc", "n3", "loading"),
        ("r4-ddddd", "n4", "unloading"),
        ("r1-aaaaa", "n1", "loaded"),
    ]
    assert (row.holdings[0].reason, row.holdings[0].failures) == ("no such dir", 2)
    assert row.why == status["unplaced"] and row.more_holdings == 0


def test_a_row_not_placed_yet_says_so_and_long_lists_and_reasons_are_cut() -> None:
    [fresh] = adapter_rows([_item("new", None, max_replicas=4)])
    assert (fresh.desired, fresh.placed, fresh.loaded, fresh.holdings) == (None, 0, 0, ())
    assert fresh.why == "not placed yet" and fresh.bounds == "–..4"
    # Placed, no reason to be short: nothing to say.
    [idle] = adapter_rows([_item("idle", {"desired_replicas": 0, "unplaced": ""})])
    assert (idle.desired, idle.why) == (0, "")

    many = [_h(f"r{i:02d}-xxxxxx", f"n{i}") for i in range(ADAPTER_HOLDINGS_SHOWN + 4)]
    status = {
        "desired_replicas": len(many),
        "replicas": many,
        "loaded": many[:-1],
        "failures": [_f(many[-1]["replica"], many[-1]["node"], "x" * 5000, 7)],
    }
    [row] = adapter_rows([_item("wide", status)])
    assert (row.placed, row.loaded, row.failing) == (len(many), len(many) - 1, 1)
    assert len(row.holdings) == ADAPTER_HOLDINGS_SHOWN and row.more_holdings == 4
    # The failing replica is listed first even though the API named it last.
    assert row.holdings[0].state == "failed" and row.holdings[0].failures == 7
    assert len(row.holdings[0].reason) == 200 and row.holdings[0].reason.endswith("…")


def test_failing_adapters_need_attention_in_the_status_commands_words() -> None:
    fails = [_f(f"r{i}-yyyyyyyy", f"n{i}", f"bad {i}", i + 1) for i in range(5)]
    status = {"desired_replicas": 5, "replicas": [_h(f["replica"], f["node"]) for f in fails],
              "loaded": [], "failures": fails}  # fmt: skip
    rows = adapter_rows(
        [_item("broken", status), _item("fine", {"desired_replicas": 1, "replicas": []})]
    )
    deployments = [{"name": "d", "status": {"stalled": True, "reason": "no capacity"}}]
    nodes = [{"name": "quiet", "approval_state": "approved", "last_sync_at": None}]
    got = attention(nodes, deployments, [], now=NOW, stale_sync_s=30, adapters=rows)
    assert [(a.what, a.subject) for a in got] == [
        ("rollout stalled", "d"),
        ("adapter load failing", "broken"),
        ("node stopped syncing", "quiet"),
    ]
    assert got[1].reason == (
        "load failed on n0 (1x): bad 0; load failed on n1 (2x): bad 1; "
        "load failed on n2 (3x): bad 2; and 2 more"
    )
    assert attention([], [], [], now=NOW, stale_sync_s=30, adapters=rows[1:]) == []


class _Page(HTMLParser):
    """A page's elements and text, its adapters' rows by field, as a browser would read them."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.rows: dict[str, dict[str, str]] = {}
        self._text: list[str] = []
        self._row: str | None = None
        self._field: str | None = None
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))
        a = dict(attrs)
        if tag == "tr" and a.get("data-adapter"):
            self._row = a["data-adapter"]
            self.rows[self._row] = {"all": ""}
        elif tag == "td" and self._row and a.get("data-field"):
            self._field = a["data-field"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None
        elif tag == "td":
            self._field = None

    def handle_data(self, data: str) -> None:
        self._text.append(data)
        if self._row is not None:
            row = self.rows[self._row]
            for key in ("all", self._field):
                if key is not None:
                    row[key] = " ".join((row.get(key, "") + " " + data).split())

    @property
    def text(self) -> str:
        return " ".join("".join(self._text).split())


def _no_markup_but_ours(page: _Page) -> None:
    """No element the page's own templates do not write: what a planted string would add."""
    names = {tag for tag, _ in page.tags}
    assert "img" not in names and "b" not in names, names
    for tag, attrs in page.tags:
        assert tag != "script" or dict(attrs).get("src"), "inline script"
        assert not any(k.startswith("on") or k == "style" for k, _ in attrs), (tag, attrs)


def test_the_table_escapes_operator_and_engine_text() -> None:
    status = {
        "desired_replicas": 2,
        "replicas": [_h("r1-aaaaaaaa", "<b>n1</b>")],
        "loaded": [],
        "failures": [_f("r1-aaaaaaaa", "<b>n1</b>", EVIL, 3)],
        "unplaced": "<b>short</b> of " + EVIL,
    }
    rows: list[AdapterRow] = adapter_rows([_item('x"><img src=y>', status)])
    html = _env.get_template("adapters_table.html").render(
        adapters=rows, more_adapters=0, adapters_paged=False, adapters_model=None
    )
    assert "<img" not in html and "<script" not in html and "<b>" not in html
    page = _Page(html)
    _no_markup_but_ours(page)
    row = page.rows['x"><img src=y>']  # the attribute held it whole
    assert row["where"] == f"r1-aaaaa on <b>n1</b>: load failed (3x): {EVIL}"
    assert row["why"] == "<b>short</b> of " + " ".join(EVIL.split())
    assert (row["desired"], row["placed"], row["loaded"]) == ("2", "1", "0")
    empty = _Page(_env.get_template("adapters_table.html").render(adapters=[]))
    assert "No adapters declared: llmgw apply a kind: adapter document." in empty.text


# --- over HTTP, against a real control plane ------------------------------------------


@pytest.fixture
def console(cp: ControlPlane) -> Iterator[httpx.Client]:
    """A browser-like client signed in to ``cp``'s console."""
    with httpx.Client(base_url=f"{cp.url}/ui", timeout=10) as c:
        r = c.post("/sign-in", data={"token": cp.token})
        assert r.status_code == 303, r.text
        yield c


def _holder(cp: ControlPlane, deployment: str, adapter: str, observed: dict[str, Any]) -> str:
    """A ready replica of ``deployment`` on a node of its own whose shard the leader told to
    hold ``adapter`` and whose agent reports ``observed`` of it; returns the replica's id."""
    node_id = insert_node(cp.db_url, name("n"), gpus=1)
    replica = insert_replica(cp.db_url, deployment, [(node_id, [0])])
    sql(
        cp.db_url,
        "UPDATE shards SET desired_adapters = %s, observed_adapters = %s WHERE replica_id = %s",
        (
            json.dumps([{"name": adapter, "path": "/a", "pinned": False}]),
            json.dumps([{"name": adapter, **observed}]),
            replica,
        ),
    )
    return str(replica)


def _get(c: httpx.Client, path: str) -> _Page:
    r = c.get(path)
    assert r.status_code == 200, (path, r.text)
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp, path
    page = _Page(r.text)
    _no_markup_but_ours(page)
    return page


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_the_overview_and_a_deployment_show_where_each_adapter_stands(
    cp: ControlPlane, client: httpx.Client, console: httpx.Client
) -> None:
    # The only test of this module on ``cp``: nothing is declared yet.
    empty = "No adapters declared: llmgw apply a kind: adapter document."
    for path in ("/overview", "/overview/live"):
        assert empty in _get(console, path).text

    model, elsewhere, profile, dep = name("base"), name("other"), name("p"), name("d")
    for m in (model, elsewhere):
        client.post("/models", json={"name": m}).raise_for_status()
    client.post(
        "/profiles",
        json={"name": profile, "model": model, "engine": "sim", "model_path": "/m",
              "adapter_slots": 2},
    ).raise_for_status()  # fmt: skip
    client.post(
        "/deployments", json={"name": dep, "model": model, "profile": profile, "replicas": 2}
    ).raise_for_status()
    assert f"No adapters declared on model {model}:" in _get(console, f"/deployments/{dep}").text

    lora, fresh, foreign = name("lora"), name("fresh"), name("foreign")
    for a, m, extra in (
        (lora, model, {"min_replicas": 1, "max_replicas": 3, "pinned": True}),
        (fresh, model, {}),
        (foreign, elsewhere, {}),
    ):
        r = client.post("/adapters", json={"name": a, "model": m, "path": "/adapters/x", **extra})
        assert r.status_code == 201, r.text
    # What the leader and the agents write: a count, why it is short, one holder loaded, one
    # failing with markup in the engine's answer.
    unplaced = "<b>only 2</b> of the 3 replicas of model m that can hold it are ready"
    sql(
        cp.db_url,
        "INSERT INTO adapter_status (adapter, desired_replicas, unplaced) VALUES (%s, 3, %s)",
        (lora, unplaced),
    )
    ok = _holder(cp, dep, lora, {"state": "loaded", "reason": "", "failures": 0})
    bad = _holder(cp, dep, lora, {"state": "failed", "reason": EVIL, "failures": 2})
    placed = client.get(f"/adapters/{lora}").json()["status"]["replicas"]
    nodes = {h["replica"]: h["node"] for h in placed}
    assert set(nodes) == {ok, bad}

    for path in ("/overview", "/overview/live"):
        page = _get(console, path)
        assert empty not in page.text
        row = page.rows[lora]
        assert row["all"].startswith(f"{lora} {model} 1..3, pinned "), row
        assert (row["desired"], row["placed"], row["loaded"]) == ("3", "2", "1"), row
        assert f"{ok[:8]} on {nodes[ok]}: loaded" in row["where"]
        failed = f"{bad[:8]} on {nodes[bad]}: load failed (2x): {' '.join(EVIL.split())}"
        assert failed in row["where"], row
        assert row["where"].index(bad[:8]) < row["where"].index(ok[:8])  # failing first
        assert row.get("why") == unplaced
        # Declared, not placed yet: no count.
        assert (page.rows[fresh]["desired"], page.rows[fresh]["why"]) == ("–", "not placed yet")
        assert foreign in page.rows
        # The failing load heads "needs attention" in `llmgw status`'s words.
        line = f"adapter load failing: {lora} — load failed on {nodes[bad]} (2x): "
        assert line + " ".join(EVIL.split()) in page.text, page.text

    # The deployment's page lists its model's adapters only.
    page = _get(console, f"/deployments/{dep}/live")
    assert set(page.rows) == {lora, fresh}, page.rows
    assert (page.rows[lora]["desired"], page.rows[lora]["loaded"]) == ("3", "1")

    # The live fragment follows what the leader and the agents write next.
    sql(
        cp.db_url,
        "UPDATE adapter_status SET desired_replicas = 2, unplaced = '' WHERE adapter = %s",
        (lora,),
    )
    sql(
        cp.db_url,
        "UPDATE shards SET observed_adapters = %s WHERE replica_id = %s",
        (json.dumps([{"name": lora, "state": "loaded", "reason": "", "failures": 0}]), bad),
    )
    page = _get(console, "/overview/live")
    row = page.rows[lora]
    assert (row["desired"], row["placed"], row["loaded"]) == ("2", "2", "2"), row
    assert "load failed" not in row["where"] and row.get("why", "") == ""
    assert "adapter load failing" not in page.text
    assert re.search(rf"{re.escape(bad[:8])} on \S+: loaded", row["where"])
