"""SIGHUP on a real `llmgw controlplane`: it re-reads its config file and applies what can change
live (the reconcile tick and rules, the log level), logs what changed, and refuses an invalid
config as a whole while it keeps serving on the settings it had."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.fleet_harness import ControlPlaneProc, Fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _write(path: Path, *, level: str, tick_s: float, grace_s: float = 2.0) -> None:
    path.write_text(
        f'[log]\nlevel = "{level}"\n\n'
        f"[controlplane.reconcile]\ntick_s = {tick_s}\nsync_period_s = 0.3\n"
        f"node_grace_s = {grace_s}\n"
    )


def _passes(cp: ControlPlaneProc) -> float:
    return cp.metric("llmgw_reconcile_passes_total") or 0.0


def _passes_in(cp: ControlPlaneProc, window_s: float) -> float:
    start = _passes(cp)
    time.sleep(window_s)  # a rate needs a window: this measures, it does not wait for a state
    return _passes(cp) - start


def _reload(f: Fleet, cp: ControlPlaneProc, event: str) -> dict[str, Any]:
    seen = len([e for e in cp.events() if e["event"] == event])
    cp.signal(signal.SIGHUP)

    def logged() -> dict[str, Any] | None:
        events = [e for e in cp.events() if e["event"] == event]
        return events[-1] if len(events) > seen else None

    return f.until(logged, timeout_s=10, what=f"{event} in the control plane's log")


def test_sighup_applies_live_settings_and_refuses_an_invalid_config(
    sim_fleet: Fleet, tmp_path: Path
) -> None:
    f = sim_fleet
    conf = tmp_path / "llmgw.toml"
    _write(conf, level="info", tick_s=0.2)
    cp = f.start_controlplane(
        "cp-a",
        config=conf,
        unset=(
            "LLMGW_LOG__LEVEL",
            "LLMGW_CONTROLPLANE__RECONCILE__TICK_S",
            "LLMGW_CONTROLPLANE__RECONCILE__SYNC_PERIOD_S",
            "LLMGW_CONTROLPLANE__RECONCILE__NODE_GRACE_S",
        ),
    )
    f.until(lambda: cp.leads(), timeout_s=10, what="leadership")
    assert _passes_in(cp, 1.0) >= 3  # ticking every 0.2 s

    # A slower tick and a quieter log level, applied live.
    _write(conf, level="warning", tick_s=30, grace_s=5)
    ev = _reload(f, cp, "config_reloaded")
    assert ev["changed"]["controlplane.reconcile.tick_s"] == {"from": 0.2, "to": 30.0}
    assert ev["changed"]["controlplane.reconcile.node_grace_s"] == {"from": 2.0, "to": 5.0}
    assert ev["changed"]["log.level"] == {"from": "info", "to": "warning"}
    assert ev["needs_restart"] == []
    assert _passes_in(cp, 1.5) <= 1  # nothing wakes it but the 30 s tick
    marker = len(cp.events())
    for _ in range(3):
        assert httpx.get(f"{cp.url}/healthz", timeout=2).status_code == 200

    # Invalid: refused as a whole, the process serves on with what it had.
    _write(conf, level="info", tick_s=-1)
    ev = _reload(f, cp, "config_reload_refused")
    assert "tick_s" in ev["error"]
    # A grace shorter than 5 sync periods is refused the same way (the planner's rule).
    _write(conf, level="info", tick_s=0.2, grace_s=1.0)
    ev = _reload(f, cp, "config_reload_refused")
    assert "5 sync periods" in ev["error"], ev
    assert cp.alive()
    assert httpx.get(f"{cp.url}/readyz", timeout=5).status_code == 200
    assert _passes_in(cp, 1.0) <= 1  # still the 30 s tick: nothing of the bad files applied
    # At warning, the access lines of the health checks above were not written.
    quiet = cp.events()[marker:]
    assert [e for e in quiet if e.get("level") == "info"] == [], quiet

    # A setting that cannot change live is named, not applied.
    conf.write_text(
        '[log]\nlevel = "warning"\n\n[controlplane]\nadmin_max_body_bytes = 4096\n\n'
        "[controlplane.reconcile]\ntick_s = 0.2\nsync_period_s = 0.3\nnode_grace_s = 2.0\n"
    )
    ev = _reload(f, cp, "config_reloaded")
    assert ev["needs_restart"] == ["controlplane.admin_max_body_bytes"], ev
    assert ev["changed"]["controlplane.reconcile.tick_s"] == {"from": 30.0, "to": 0.2}
    assert _passes_in(cp, 1.0) >= 3
