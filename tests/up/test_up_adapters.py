"""Runtime LoRA adapters through `llmgw up`'s demo (simulator engines, `adapter_slots` in the
demo profile): `llmgw apply` an adapter and a request for it is answered with no engine
restarted; a hot adapter's demand brings it to a second replica; an adapter whose path does not
exist is refused by name with the engine's reason, visible in `llmgw status`; a deleted adapter
is unloaded from every replica and its name is a 404."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import pg_dir
from tests.support.waiting import WaitTimeout, wait_for
from tests.up.up_harness import Up, our_pids, shard_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _adapter_doc(name: str, path: Path | str, **extra: object) -> str:
    lines = [
        "kind: adapter",
        f"name: {name}",
        "model: demo",
        f"path: {path}",
        *(f"{k}: {json.dumps(v)}" for k, v in extra.items()),
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def up_info() -> Iterator[tuple[Up, dict[str, Any], Path]]:
    with pg_dir() as root:
        up = Up.new(root).start()
        try:
            info = up.wait_up()
            adapters = root / "adapters"
            adapters.mkdir()
            yield up, info, adapters
        finally:
            assert up.stop() == 0, up.logs()


def _chat(info: dict[str, Any], model: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(
        f"{info['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {info['api_key']}"},
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Which tables hold the orders?"}],
            "max_tokens": max_tokens,
        },
        timeout=120,
    )


def _status(info: dict[str, Any], name: str) -> dict[str, Any]:
    r = httpx.get(
        f"{info['admin_url']}/admin/v1/adapters/{name}",
        headers={"Authorization": f"Bearer {info['admin_token']}"},
        timeout=10,
    )
    r.raise_for_status()
    status: dict[str, Any] = r.json()["status"]
    return status


def _engines(up: Up, info: dict[str, Any]) -> dict[int, str]:
    return {p: c for p, c in our_pids(up, shard_ids(info)).items() if "simengine" in c}


def _ready(up: Up) -> bool:
    st = up.status_json()
    return len([s for s in st["shards"] if s["state"] == "ready"]) == 2


def test_an_applied_adapter_is_loaded_at_runtime_and_served(
    up_info: tuple[Up, dict[str, Any], Path],
) -> None:
    up, info, adapters = up_info
    wait_for(lambda: _ready(up), timeout_s=90, what="the demo's two replicas ready")
    engines = _engines(up, info)
    assert len(engines) == 2, engines
    (adapters / "sql").mkdir()
    up.cli("apply", "-f", "-", stdin=_adapter_doc("demo-runtime-sql", adapters / "sql"))

    # Held while the leader places it and an agent loads it, then answered by the adapter.
    r = _chat(info, "demo-runtime-sql")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "demo-runtime-sql"
    status = _status(info, "demo-runtime-sql")
    assert status["desired_replicas"] == 1 and len(status["loaded"]) == 1, status
    # No engine restarted: loading is the running engine's own call.
    assert _engines(up, info) == engines
    table = up.cli("get", "adapters")
    assert "demo-runtime-sql" in table and "1/1" in table, table
    actions = up.cli("get", "actions")
    assert "demo-runtime-sql" in actions, actions


def test_a_hot_adapter_is_loaded_on_a_second_replica(
    up_info: tuple[Up, dict[str, Any], Path],
) -> None:
    up, info, adapters = up_info
    (adapters / "hot").mkdir()
    up.cli("apply", "-f", "-", stdin=_adapter_doc("demo-hot", adapters / "hot"))
    assert _chat(info, "demo-hot").status_code == 200
    assert len(_status(info, "demo-hot")["loaded"]) == 1
    engines = _engines(up, info)

    # More requests at once than one holder's target (16 in flight): the leader adds a holder.
    stop = threading.Event()
    failures: list[str] = []

    def client() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(
                    f"{info['base_url']}/chat/completions",
                    headers={"Authorization": f"Bearer {info['api_key']}"},
                    json={
                        "model": "demo-hot",
                        "messages": [{"role": "user", "content": "Write a long report."}],
                        "max_tokens": 256,
                    },
                )
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=client, daemon=True) for _ in range(24)]
    for t in threads:
        t.start()
    try:
        wait_for(
            lambda: len(_status(info, "demo-hot")["loaded"]) == 2 or None,
            timeout_s=90,
            what="the hot adapter loaded on both replicas",
            interval_s=1,
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
    assert not failures, failures[:5]
    assert _engines(up, info) == engines


def test_a_missing_path_is_refused_by_name_and_shown(
    up_info: tuple[Up, dict[str, Any], Path],
) -> None:
    up, info, adapters = up_info
    missing = adapters / "never-made"
    up.cli("apply", "-f", "-", stdin=_adapter_doc("demo-broken", missing))
    r = _chat(info, "demo-broken")
    # Not a hang: the load's failure, with the engine's reason naming the path.
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "adapter_load_failed" and "demo-broken" in error["message"], error
    assert str(missing) in error["message"], error
    failures = _status(info, "demo-broken")["failures"]
    assert failures and str(missing) in failures[0]["reason"], failures
    assert "demo-broken" in up.cli("status")


def test_a_deleted_adapter_is_unloaded_everywhere_and_is_a_404(
    up_info: tuple[Up, dict[str, Any], Path],
) -> None:
    up, info, adapters = up_info
    if not (adapters / "gone").exists():
        (adapters / "gone").mkdir()
    up.cli("apply", "-f", "-", stdin=_adapter_doc("demo-gone", adapters / "gone"))
    assert _chat(info, "demo-gone").status_code == 200
    r = httpx.delete(
        f"{info['admin_url']}/admin/v1/adapters/demo-gone",
        headers={"Authorization": f"Bearer {info['admin_token']}"},
        timeout=10,
    )
    assert r.status_code in (200, 204), r.text

    def unloaded() -> bool:
        held = {a["name"] for s in _shards(info) for a in s["adapters"]}
        return "demo-gone" not in held and _chat(info, "demo-gone").status_code == 404

    wait_for(unloaded, timeout_s=60, what="demo-gone unloaded from every replica, then a 404")

    # The others stay loaded where they were: an unload is that adapter's alone.
    def others_loaded() -> bool:
        held = {a["name"] for s in _shards(info) for a in s["adapters"] if a["state"] == "loaded"}
        return {"demo-runtime-sql", "demo-hot"} <= held

    try:
        wait_for(others_loaded, timeout_s=30, what="the other adapters loaded")
    except WaitTimeout:
        shards = _shards(info)
        raise AssertionError(
            [(s["id"], s["desired_adapters"], s["adapters"]) for s in shards],
            _status(info, "demo-runtime-sql"),
            up.cli("get", "actions"),
        ) from None


def _shards(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Every live shard of the demo as the admin API shows it (its runtime adapters included)."""
    r = httpx.get(
        f"{info['admin_url']}/admin/v1/replicas",
        params={"limit": 500},
        headers={"Authorization": f"Bearer {info['admin_token']}"},
        timeout=10,
    )
    r.raise_for_status()
    return [s for rep in r.json()["items"] for s in rep["shards"] if not s["released"]]
