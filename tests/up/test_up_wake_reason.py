"""Finding 9 (hardening-3) through `llmgw up`: a wake from zero that cannot succeed answered
every held request after the whole 30 s with "overloaded ... add replicas". Here the demo is
autoscaled to zero, then its profile asks for a GPU class no node has: a chat is held, its
demand wakes the leader, the leader cannot place a replica, and the held chat is answered
within seconds with 503 + Retry-After naming that reason (the route table carries it)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.waiting import wait_for
from tests.up.test_up_autoscale import _POLICY
from tests.up.up_harness import Up

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(180),
]


def _deployment(up: Up) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(up.cli("get", "deployments", "demo", "-o", "json"))
    return out


def test_a_wake_that_cannot_succeed_answers_the_held_request_with_the_reason(
    pg_tmp_path: Path,
) -> None:
    up = Up.new(pg_tmp_path).start()
    try:
        info = up.wait_up()
        up.cli("apply", "-f", "-", stdin=_POLICY)

        def at_zero() -> bool:
            # No replica left in any state: one still draining makes the leader's reason
            # "waiting for draining replicas", a wake that may yet succeed, not held against it.
            status = _deployment(up)["status"]
            return bool(status["replicas"] == 0 and status["suspended_replicas"] == 0)

        wait_for(at_zero, timeout_s=60, what="the idle demo scaled to zero", interval_s=0.3)
        admin = httpx.Client(
            base_url=info["admin_url"],
            headers={"Authorization": f"Bearer {info['admin_token']}"},
            timeout=10,
        )
        name = _deployment(up)["profile"]
        profile = admin.get(f"/admin/v1/profiles/{name}").json()
        r = admin.patch(
            f"/admin/v1/profiles/{name}",
            json={"version": profile["version"], "gpu_class": "no-such-gpu"},
        )
        assert r.status_code == 200, r.text

        t0 = time.monotonic()
        r = httpx.post(
            f"{info['base_url']}/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "wake"}]},
            headers={"Authorization": f"Bearer {info['api_key']}"},
            timeout=60,
        )
        took_s = time.monotonic() - t0
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "cannot place a replica" in message and "no-such-gpu" in message, message
        assert int(r.headers["Retry-After"]) >= 1
        assert took_s < 20, took_s  # the leader's pass and a route re-read, not the 30 s wait
        print(f"held chat answered in {took_s:.1f} s: {message}")
    finally:
        assert up.stop() == 0
