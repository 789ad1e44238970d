"""`llmgw status`'s node STATE is the console's judgement (finding 17): a node silent for
1,000 s was `ok` on `llmgw status` while the console listed it as "node stopped syncing".
Both now read ``fleet_view.node_state`` / ``stopped_syncing``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from llmgw.commands import status
from llmgw.controlplane.console.fleet_view import STALE_SYNC_S, attention, node_state


def _iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def _api_node(name: str, silent_s: float | None, **kw: Any) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {
        "name": name,
        "approval_state": "approved",
        "pool": "default",
        "num_gpus": 2,
        "free_gpus": 0,
        "num_shards": 2,
        "cordoned": False,
        "draining": False,
        "last_sync_at": None if silent_s is None else _iso(now - timedelta(seconds=silent_s)),
        **kw,
    }


class _Client:
    """The admin API as `collect` reads it."""

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.nodes = nodes

    def list_all(self, kind: str, **_params: Any) -> list[dict[str, Any]]:
        return self.nodes if kind == "nodes" else []

    def request(self, _method: str, _path: str, **_kw: Any) -> Any:
        return {"items": []}


def _collect(nodes: list[dict[str, Any]], monkeypatch: Any) -> dict[str, Any]:
    monkeypatch.setattr(status, "_metrics", lambda _conn: None)
    return status.collect(_Client(nodes), None)  # type: ignore[arg-type]


def test_a_silent_node_is_stopped_syncing_on_both_screens(monkeypatch: Any) -> None:
    nodes = [
        _api_node("silent", 1000),
        _api_node("fresh", 1),
        _api_node("drained", 2, draining=True, cordoned=True),
        _api_node("fenced", 2, cordoned=True),
        _api_node("new", None, approval_state="pending"),
    ]
    data = _collect(nodes, monkeypatch)
    states = {n["name"]: n["state"] for n in data["nodes"]}
    assert states == {
        "silent": "stopped syncing",
        "fresh": "ok",
        "drained": "draining",
        "fenced": "cordoned",
        "new": "pending approval",
    }
    screen = status.render(data)
    (silent_row,) = [line for line in screen.splitlines() if line.startswith("silent")]
    assert "stopped syncing" in silent_row and "1000s ago" in silent_row
    # The console's "needs attention" says the same of the same nodes.
    flagged = attention(nodes, [], [], now=datetime.now(UTC), stale_sync_s=STALE_SYNC_S)
    assert {a.subject for a in flagged if a.what == "node stopped syncing"} == {"silent"}


def test_the_state_rule_at_its_edges() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)

    def state(silent_s: float | None, **kw: Any) -> str:
        at = None if silent_s is None else _iso(now - timedelta(seconds=silent_s))
        fields: dict[str, Any] = {"approval": "approved", "cordoned": False, "draining": False}
        fields.update(kw)
        return node_state(last_sync_at=at, now=now, **fields)

    assert state(STALE_SYNC_S) == "ok"
    assert state(STALE_SYNC_S + 1) == "stopped syncing"
    assert state(None) == "stopped syncing"  # approved and never synced
    # Silence outranks draining: the node is not draining anything while it is gone.
    assert state(1000, draining=True) == "stopped syncing"
    assert state(None, approval="pending") == "pending approval"


def test_a_screen_rendered_from_older_json_still_derives_the_state() -> None:
    row = {
        "name": "old",
        "approval": "approved",
        "pool": "default",
        "gpus": 2,
        "free_gpus": 0,
        "shards": 0,
        "cordoned": False,
        "draining": False,
        "last_sync_at": _iso(datetime.now(UTC) - timedelta(seconds=1000)),
    }
    screen = status.render({"nodes": [row], "deployments": [], "shards": [], "prefix_routing": {}})
    assert "stopped syncing" in screen
