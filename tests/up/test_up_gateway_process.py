"""`llmgw up --gateway-workers 1`: the OpenAI API served by a `llmgw gateway` process of its
own, apart from the control plane (which runs with --no-public-listener). The demo answers
through it, precise KV routing still hits (the agents relay their KV deltas to the gateway's
private listener, which it registered in controlplane_instances), and a gateway killed
outright is restarted by `up` and answers again."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.waiting import wait_for
from tests.up.up_harness import Up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# Long enough to fill several KV blocks of the demo model: a precise decision needs held blocks.
SYSTEM = "You are a careful assistant who answers in one word. " * 40


def _children(up: Up) -> dict[str, int]:
    records = json.loads((up.data_dir / "children.json").read_text())
    return {r["name"]: int(r["pid"]) for r in records}


def _cmdline(pid: int) -> str:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()


def _chat(info: dict[str, Any], question: str) -> httpx.Response:
    return httpx.post(
        f"{info['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {info['api_key']}"},
        json={"model": "demo", "max_tokens": 2,
              "messages": [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": question}]},
        timeout=10,
    )  # fmt: skip


def _gateway_urls(up: Up) -> list[str]:
    """The private URLs the gateway processes announced in their log, in start order."""
    path = up.data_dir / "logs" / "gateway.log"
    if not path.exists():
        return []
    urls = []
    for line in path.read_text(errors="replace").splitlines():
        if '"gateway_starting"' in line:
            urls.append(json.loads(line)["private_url"])
    return urls


def _precise_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "llmgw_prefix_decisions"
        for s in f.samples
        if s.name.endswith("_total")
        and s.labels.get("method") == "precise"
        and s.labels.get("outcome") == "hit"
    )


def _ok(info: dict[str, Any], question: str) -> bool:
    try:
        return _chat(info, question).status_code == 200
    except httpx.HTTPError:
        return False


def test_up_serves_chats_from_a_gateway_process_restarted_after_kill_9(pg_tmp_path: Path) -> None:
    up = Up.new(pg_tmp_path).start("--gateway-workers", "1")
    try:
        info = up.wait_up()
        pids = _children(up)
        assert pids["gateway"] != pids["controlplane"]
        assert "--no-public-listener" in _cmdline(pids["controlplane"])
        assert "gateway --host" in _cmdline(pids["gateway"])
        r = _chat(info, "question zero")
        assert r.status_code == 200, r.text[:500]

        # The gateway registered its private listener; agents feed its KV index.
        urls = wait_for(lambda: _gateway_urls(up), timeout_s=20, what="the gateway's start line")
        assert len(urls) == 1, urls
        url = urls[0]
        assert httpx.get(f"{url}/healthz", timeout=5).json()["status"] == "ok"
        wait_for(
            lambda: _ok(info, f"warm {os.urandom(4).hex()}") and _precise_hits(url) > 0,
            timeout_s=30,
            what="a precise hit in the gateway process",
        )
        # The control plane, without a public listener, shows the gateway's metrics as its own.
        wait_for(
            lambda: _precise_hits(info["admin_url"]) > 0,
            timeout_s=10,
            what="the gateway's metrics on the control plane's /metrics",
        )

        # Killed outright: `up` restarts it, and chats work again (a new instance row).
        os.kill(pids["gateway"], signal.SIGKILL)
        wait_for(
            lambda: _children(up).get("gateway") not in (None, pids["gateway"]),
            timeout_s=30,
            what="up to restart the gateway",
        )
        wait_for(lambda: _ok(info, "after"), timeout_s=30, what="chats after the restart")
        # The control plane never stopped serving: same pid, still ready.
        assert _children(up)["controlplane"] == pids["controlplane"]
        assert httpx.get(f"{info['admin_url']}/readyz", timeout=5).status_code == 200
    finally:
        assert up.stop() == 0, up.logs()


def _kv_applied(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "llmgw_agent_kv_requests"
        for s in f.samples
        if s.name.endswith("_total") and s.labels.get("result") not in ("invalid", "throttled")
    )


def test_two_gateway_workers_share_the_port_and_each_gets_the_kv_deltas(
    pg_tmp_path: Path,
) -> None:
    up = Up.new(pg_tmp_path).start("--gateway-workers", "2")
    try:
        info = up.wait_up()
        urls = wait_for(
            lambda: (u := _gateway_urls(up)) and len(u) >= 2 and u,
            timeout_s=20,
            what="both workers' start lines",
        )
        assert len(set(urls)) == 2, urls  # each worker its own private listener and instance
        for i in range(8):
            r = _chat(info, f"question {i}")
            assert r.status_code == 200, r.text[:500]
        # Every worker is an instance the agents relay to: each one's index is fed.
        for url in urls:
            wait_for(lambda u=url: _kv_applied(u) > 0, timeout_s=30, what=f"KV deltas at {url}")
    finally:
        assert up.stop() == 0, up.logs()
