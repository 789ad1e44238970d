"""The console's pure parts: sessions (expiry, sign-out, the cap, CSRF) and what the pages
show (the needs-attention list, GPUs per name, the engine's last log line)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from llmgw.controlplane.console.fleet_view import (
    attention,
    gpus_per_class,
    last_log_line,
    suspended,
)
from llmgw.controlplane.console.sessions import SessionStore

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def test_sessions_expire_idle_and_absolute_and_end_on_sign_out() -> None:
    store = SessionStore(ttl_s=100, idle_s=10)
    s = store.create(0)
    assert store.get(s.id, 9) is s  # seen: the idle timer restarts
    assert store.get(s.id, 18) is s
    assert store.get(s.id, 29) is None  # idle 11 s
    s = store.create(50)
    for t in range(55, 150, 5):
        assert store.get(s.id, t) is s
    assert store.get(s.id, 150) is None  # 100 s old, however active
    s = store.create(200)
    store.end(s.id)
    assert store.get(s.id, 201) is None
    assert store.get(None, 201) is None and store.get("forged", 201) is None


def test_sessions_are_capped_evicting_the_least_recently_seen() -> None:
    store = SessionStore(ttl_s=1000, idle_s=1000, max_sessions=3)
    a, b, c = store.create(0), store.create(1), store.create(2)
    store.get(a.id, 3)
    d = store.create(4)
    assert len(store) == 3
    assert store.get(b.id, 5) is None
    assert all(store.get(x.id, 5) is x for x in (a, c, d))


def test_csrf_tokens_are_per_session() -> None:
    store = SessionStore(ttl_s=10, idle_s=10)
    a, b = store.create(0), store.create(0)
    assert SessionStore.csrf_ok(a, a.csrf)
    assert not SessionStore.csrf_ok(a, b.csrf)
    assert not SessionStore.csrf_ok(a, None) and not SessionStore.csrf_ok(a, "")


def _shard(state: str, restarts: int = 0, reason: str = "", tail: str = "") -> dict[str, object]:
    return {
        "id": "0123456789", "node": "n1", "observed_state": state, "restarts": restarts,
        "reason": reason, "log_tail": tail, "released": False,
    }  # fmt: skip


def test_attention_puts_failing_shards_first_with_the_engines_own_words() -> None:
    tail = "starting\n╭─ Error ─╮\n│ No such option: --bad │\n╰─────────╯\n"
    replicas = [
        {"deployment": "a", "shards": [_shard("ready"), _shard("starting", restarts=5)]},
        {"deployment": "b", "shards": [_shard("failed", 3, "crash loop: exited 2", tail)]},
        {"deployment": "c", "shards": [{**_shard("failed"), "released": True}]},
    ]
    deployments = [{"name": "d", "status": {"stalled": True, "reason": "no capacity"}}]
    nodes = [
        {"name": "fresh", "approval_state": "approved", "last_sync_at": NOW.isoformat()},
        {"name": "quiet", "approval_state": "approved",
         "last_sync_at": (NOW - timedelta(seconds=120)).isoformat()},
        {"name": "new", "approval_state": "pending", "last_sync_at": None},
    ]  # fmt: skip
    replicas.append({"deployment": "e", "shards": [{**_shard("ready"), "id": "kv-shard-1"}]})
    kv = {"kv-shard-1": "partial", "0123456789": "incomplete", "gone": "partial"}
    got = attention(nodes, deployments, replicas, now=NOW, stale_sync_s=30, kv_not_whole=kv)
    assert [(a.what, a.subject.split()[0]) for a in got] == [
        ("shard failed", "b"),
        ("crash-looping", "a"),
        ("rollout stalled", "d"),
        ("node stopped syncing", "quiet"),
        # A failing shard's view is not news; a shard no replica holds is not listed.
        ("KV view incomplete", "a"),
        ("KV view incomplete", "a"),
        ("KV view partial", "e"),
        ("node pending approval", "new"),
    ]
    assert "after losing events" in got[6].reason
    assert got[0].reason == "crash loop: exited 2; the engine said: No such option: --bad"
    assert got[3].reason == "last sync 120s ago"


def test_last_log_line_and_gpus_per_name() -> None:
    assert last_log_line("a\nb\n\n  \n") == "b"
    assert last_log_line("") == ""
    node = {
        "num_gpus": 3, "free_gpus": 1,
        "inventory": {"gpus": [{"name": "sim"}, {"name": "sim"}, {"name": "sim"}]},
    }  # fmt: skip
    assert gpus_per_class(node) == [("sim", 2, 1)]
    assert gpus_per_class({"num_gpus": 0, "free_gpus": 0, "inventory": {}}) == []


def test_suspended_replicas_are_unknown_until_the_api_reports_them() -> None:
    assert suspended({"status": {"ready_replicas": 2}}) is None
    assert suspended({"status": None}) is None and suspended({}) is None
    assert suspended({"status": {"suspended_replicas": 0}}) == 0
    assert suspended({"status": {"suspended_replicas": 3}}) == 3
    assert suspended({"status": {"suspended_replicas": True}}) is None
