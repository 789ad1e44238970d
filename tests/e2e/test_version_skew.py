"""Version skew on the agent API of a real control plane process (policy: the docstring of
``llmgw.controlplane.agentapi``): requests of a newer or older agent, with fields this control
plane does not know, or without ones it added since, are accepted; a protocol version it does
not speak is refused with 426 and a message that says what to upgrade."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from llmgw.protocol.sync import PROTOCOL_VERSION, REGISTER_PATH, SYNC_PATH
from tests.e2e.fleet_harness import Fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _inventory() -> dict[str, Any]:
    return {
        "gpus": [
            {
                "index": 0,
                "uuid": "SIM-0",
                "name": "sim",
                "gpu_class": "sim",
                "simulated": True,
                "a_field_from_the_future": {"nested": [1, 2]},
            }
        ],
        "cpu_threads": 4,
        "source": "sim",
        "numa_nodes": 2,  # unknown here
    }


def test_unknown_fields_and_missing_new_fields_are_accepted(sim_fleet: Fleet) -> None:
    f = sim_fleet
    cp = f.start_controlplane("cp-a", env={"LLMGW_CONTROLPLANE__RECONCILE__ENABLED": "false"})
    token = f.token()
    with httpx.Client(base_url=cp.url, timeout=10) as http:
        r = http.post(
            REGISTER_PATH,
            json={
                "protocol_version": PROTOCOL_VERSION,
                "bootstrap_token": token,
                "node_name": "skewed",
                "mgmt_addr": "127.0.0.1",
                "inventory": _inventory(),
                "agent_version": "9.9.0",
                "capabilities": ["kv-v2"],  # a newer agent's field
            },
        )
        assert r.status_code == 200, r.text
        reg = r.json()
        auth = {"Authorization": f"Bearer {reg['node_credential']}"}
        assert f.sql(
            "SELECT s.inventory -> 'gpus' -> 0 ->> 'uuid' FROM node_status s "
            "JOIN nodes n ON n.id = s.node_id WHERE n.name = 'skewed'"
        ) == [("SIM-0",)]

        # A newer agent: unknown fields at every level.
        r = http.post(
            SYNC_PATH,
            headers=auth,
            json={
                "protocol_version": PROTOCOL_VERSION,
                "node_id": reg["node_id"],
                "agent_epoch": 1,
                "seq": 1,
                "bindings": [],
                "inventory": _inventory(),
                "clock_skew_ms": 3,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["cluster_id"] == reg["cluster_id"]
        assert body["unchanged"] is False and body["shards"] == []

        # An older agent: no protocol_version (it predates the field), no inventory, no
        # desired_version; defaults fill them in.
        r = http.post(
            SYNC_PATH,
            headers=auth,
            json={"node_id": reg["node_id"], "agent_epoch": 1, "seq": 2},
        )
        assert r.status_code == 200, r.text
        assert f.sql(
            "SELECT s.last_sync_at IS NOT NULL FROM node_status s "
            "JOIN nodes n ON n.id = s.node_id WHERE n.name = 'skewed'"
        ) == [(True,)]

        # A protocol this control plane does not speak: refused, saying what to do.
        r = http.post(
            SYNC_PATH,
            headers=auth,
            json={
                "protocol_version": PROTOCOL_VERSION + 1,
                "node_id": reg["node_id"],
                "agent_epoch": 1,
                "seq": 3,
            },
        )
        assert r.status_code == 426, r.text
        assert r.json()["code"] == "protocol-version"
        assert "upgrade" in r.json()["message"]
