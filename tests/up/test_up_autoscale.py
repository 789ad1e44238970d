"""Scale to zero and back through `llmgw up`'s demo, as an operator would: `llmgw apply` gives
the demo deployment an autoscale policy (min 0); idle, its replicas are suspended, then
stopped; a streaming chat then finds no ready replica, is held in the gateway's queue while
the leader starts one, and is answered whole. `llmgw get actions` names each step's reason.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.waiting import wait_for
from tests.up.up_harness import Up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

_POLICY = """\
kind: deployment
name: demo
model: demo
profile: demo-sim
replicas: 2
max_surge: "1"
max_unavailable: "0"
autoscale:
  min_replicas: 0
  max_replicas: 2
  target_waiting_requests: 4
  scale_down_window_s: 1
  suspend_after_s: 2
  zero_after_s: 5
"""


def _deployment(up: Up) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(up.cli("get", "deployments", "demo", "-o", "json"))
    return out


def test_the_demo_scales_to_zero_when_idle_and_a_held_stream_is_answered(
    pg_tmp_path: Path,
) -> None:
    up = Up.new(pg_tmp_path).start()
    try:
        info = up.wait_up()
        up.cli("apply", "-f", "-", stdin=_POLICY)
        assert _deployment(up)["autoscale"]["zero_after_s"] == 5

        def at_zero() -> bool:
            status = _deployment(up)["status"]
            return bool(status["ready_replicas"] == 0 and status["suspended_replicas"] == 0)

        wait_for(at_zero, timeout_s=60, what="the idle demo scaled to zero", interval_s=0.3)

        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "wake up"}],
            "max_tokens": 8,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {info['api_key']}"}
        t0 = time.monotonic()
        with httpx.stream(
            "POST", f"{info['base_url']}/chat/completions", json=body, headers=headers, timeout=90
        ) as r:
            text = "".join(r.iter_text())
        took_s = time.monotonic() - t0
        assert r.status_code == 200, text
        assert text.rstrip().endswith("data: [DONE]"), text
        # The status is the reconciler's, written on its next pass after the replica serves.
        wait_for(
            lambda: _deployment(up)["status"]["ready_replicas"] == 1,
            timeout_s=15,
            what="the status to count the woken replica",
            interval_s=0.3,
        )

        actions = up.cli("get", "actions", "demo")
        assert "0→1" in actions and "held with no ready replica" in actions, actions
        # Suspended before stopped, whether or not a poll saw the few seconds between.
        assert "suspend_after_s 2" in actions and "zero_after_s 5" in actions, actions
        metrics = httpx.get(f"{info['admin_url']}/metrics", timeout=10).text
        assert "llmgw_gateway_wake_seconds_count" in metrics
        print(f"held stream answered in {took_s:.1f} s")
    finally:
        assert up.stop() == 0
