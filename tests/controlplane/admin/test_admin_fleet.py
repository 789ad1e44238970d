"""The fleet half of the admin API over real HTTP against a real `llmgw controlplane` and
Postgres: nodes, bootstrap tokens, replicas, actions, GPU classes, deployment status and
generations, and the NOTIFY that wakes the reconciler."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from llmgw.embedded_postgres import libpq_url as libpq
from tests.controlplane.admin.admin_testkit import (
    ControlPlane,
    count,
    insert_node,
    insert_replica,
    name,
    sql,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _ok(r: httpx.Response, status: int = 200) -> Any:
    assert r.status_code == status, r.text
    return r.json() if r.content else None


def _refused(r: httpx.Response, status: int, field: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    return str(err["message"])


def _deployment(client: httpx.Client, **extra: Any) -> tuple[str, str, dict[str, Any]]:
    model, profile = name("m"), name("p")
    _ok(client.post("/models", json={"name": model}), 201)
    _ok(
        client.post(
            "/profiles",
            json={"name": profile, "model": model, "engine": "sim", "model_path": "/m"},
        ),
        201,
    )
    dep = _ok(
        client.post(
            "/deployments", json={"name": name("d"), "model": model, "profile": profile, **extra}
        ),
        201,
    )
    return model, profile, dep


def _audit_actions(cp: ControlPlane, kind: str, obj: str) -> list[str]:
    rows = sql(
        cp.db_url,
        "SELECT action FROM audit_log WHERE object_kind = %s AND object_name = %s ORDER BY id",
        (kind, obj),
    )
    return [r[0] for r in rows]


# --- nodes ------------------------------------------------------------------


def test_nodes_show_inventory_free_gpus_and_shards(client: httpx.Client, cp: ControlPlane) -> None:
    node = name("n")
    node_id = insert_node(cp.db_url, node, gpus=4, mig_parent=True)
    _, _, dep = _deployment(client)
    insert_replica(cp.db_url, dep["name"], [(node_id, [0, 1])])
    # A released shard's GPUs are free again and it is not counted.
    insert_replica(cp.db_url, dep["name"], [(node_id, [2])], released=True)
    out = _ok(client.get(f"/nodes/{node}"))
    # 4 whole GPUs + 2 MIG instances are placeable; the MIG-enabled parent is not.
    assert (out["num_gpus"], out["free_gpus"], out["num_shards"]) == (6, 4, 1)
    assert out["approval_state"] == "pending" and out["agent_version"] == "0.1.0"
    assert out["last_sync_at"] is not None and len(out["inventory"]["gpus"]) == 7
    listed = {n["name"]: n for n in _ok(client.get("/nodes", params={"limit": 1000}))["items"]}
    assert listed[node]["free_gpus"] == 4
    _refused(client.get("/nodes/no-such-node"), 404, "name")


def test_node_admin_actions_and_their_audit(client: httpx.Client, cp: ControlPlane) -> None:
    node = name("n")
    insert_node(cp.db_url, node)
    out = _ok(client.patch(f"/nodes/{node}", json={"labels": {"rack": "r1"}, "pool": "batch"}))
    assert out["labels"] == {"rack": "r1"} and out["pool"] == "batch"
    _refused(client.patch(f"/nodes/{node}", json={"colour": "red"}), 422, "colour")
    bad = client.patch(f"/nodes/{node}", json={"labels": {"bad key!": "x"}})
    assert bad.status_code == 422 and bad.json()["error"]["field"].startswith("labels.bad key!")
    assert _ok(client.post(f"/nodes/{node}/cordon", json={}))["cordoned"] is True
    drained = _ok(client.post(f"/nodes/{node}/drain", json={}))
    assert drained["cordoned"] and drained["draining"]
    back = _ok(client.post(f"/nodes/{node}/uncordon", json={}))
    assert not back["cordoned"] and not back["draining"]
    assert _ok(client.post(f"/nodes/{node}/approve", json={}))["approval_state"] == "approved"
    # Approving again changes nothing and writes no audit row.
    _ok(client.post(f"/nodes/{node}/approve", json={}))
    assert _audit_actions(cp, "node", node) == ["update", "cordon", "drain", "uncordon", "approve"]
    _refused(client.post("/nodes/ghost/cordon", json={}), 404, "name")


def test_a_node_with_live_shards_cannot_be_deleted(client: httpx.Client, cp: ControlPlane) -> None:
    node = name("n")
    node_id = insert_node(cp.db_url, node)
    _, _, dep = _deployment(client)
    replica = insert_replica(cp.db_url, dep["name"], [(node_id, [0])])
    message = _refused(client.delete(f"/nodes/{node}"), 409, "name")
    assert dep["name"] in message and "drain" in message and f"nodes/{node}/drain" in message
    assert count(cp.db_url, "nodes", "name = %s", (node,)) == 1
    # Once the agent reports the engine gone, the shard is released: the delete goes through
    # and takes the released shard rows with it.
    sql(cp.db_url, "UPDATE shards SET released = true WHERE replica_id = %s", (replica,))
    _ok(client.delete(f"/nodes/{node}"), 204)
    assert count(cp.db_url, "nodes", "name = %s", (node,)) == 0
    assert count(cp.db_url, "shards", "replica_id = %s", (replica,)) == 0
    assert _audit_actions(cp, "node", node) == ["delete"]


# --- bootstrap tokens -------------------------------------------------------


def test_bootstrap_tokens_show_the_secret_once(client: httpx.Client, cp: ControlPlane) -> None:
    created = _ok(
        client.post("/bootstrap-tokens", json={"pool": "gpu", "require_approval": True}), 201
    )
    token, token_id = created["token"], created["id"]
    assert token.startswith(f"llmgwb_{token_id}_") and created["uses_left"] == 1
    secret = token.removeprefix(f"llmgwb_{token_id}_")  # the secret itself may hold "_"
    one = client.get(f"/bootstrap-tokens/{token_id}")
    assert _ok(one)["pool"] == "gpu" and secret not in one.text and "token" not in one.json()
    listing = client.get("/bootstrap-tokens", params={"limit": 1000})
    assert token_id in [t["id"] for t in _ok(listing)["items"]] and secret not in listing.text
    audit = sql(cp.db_url, "SELECT after::text FROM audit_log WHERE object_name = %s", (token_id,))
    assert audit and secret not in audit[0][0]
    assert secret not in cp.log.read_text()
    unlimited = _ok(client.post("/bootstrap-tokens", json={"uses": None, "ttl_s": 60}), 201)
    assert unlimited["uses_left"] is None

    _ok(client.delete(f"/bootstrap-tokens/{token_id}"), 204)
    assert _ok(client.get(f"/bootstrap-tokens/{token_id}"))["revoked"] is True
    _ok(client.delete(f"/bootstrap-tokens/{token_id}"), 204)  # again: still revoked, no new row
    assert _audit_actions(cp, "bootstrap-token", token_id) == ["create", "revoke"]
    _refused(client.get("/bootstrap-tokens/nope"), 404, "id")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"ttl_s": 10}, "ttl_s"),
        ({"ttl_s": 31 * 86_400}, "ttl_s"),
        ({"uses": 0}, "uses"),
        ({"pool": "bad pool"}, "pool"),
        ({"secret": "mine"}, "secret"),
    ],
)
def test_bootstrap_token_bounds(
    client: httpx.Client, cp: ControlPlane, body: dict[str, Any], field: str
) -> None:
    before = count(cp.db_url, "bootstrap_tokens")
    _refused(client.post("/bootstrap-tokens", json=body), 422, field)
    assert count(cp.db_url, "bootstrap_tokens") == before


# --- replicas ---------------------------------------------------------------


def test_replicas_with_their_shards(client: httpx.Client, cp: ControlPlane) -> None:
    a, b = name("n"), name("n")
    a_id, b_id = insert_node(cp.db_url, a), insert_node(cp.db_url, b)
    _, profile, dep = _deployment(client)
    current = _ok(client.get(f"/profiles/{profile}"))["fingerprint"]
    sql(
        cp.db_url,
        "INSERT INTO deployment_status (deployment_id, reason) SELECT id, %s FROM deployments "
        "WHERE name = %s",
        ("needs 2 nodes x 1 sim GPU; 1 node has a free one", dep["name"]),
    )
    stale = insert_replica(
        cp.db_url, dep["name"], [(a_id, [0]), (b_id, [1, 2])], log_tail="x" * 20_000,
        observed_state="failed",
    )  # fmt: skip
    fresh = insert_replica(cp.db_url, dep["name"], [(a_id, [3])], fingerprint=current)
    orphan = insert_replica(cp.db_url, None, [(b_id, [0])])

    out = _ok(client.get(f"/replicas/{stale}"))
    assert out["deployment"] == dep["name"] and out["stale"] is True and out["ready"] is False
    assert out["deployment_reason"].startswith("needs 2 nodes")
    assert [(s["node"], s["rank"]) for s in out["shards"]] == [(a, 0), (b, 1)]
    assert [g["index"] for g in out["shards"][1]["gpus"]] == [1, 2]
    shard = out["shards"][0]
    assert shard["observed_state"] == "failed" and shard["restarts"] == 2
    assert shard["exit_code"] == 1 and len(shard["log_tail"]) == 8192
    assert "engine_api_key" not in shard and "launch_spec" not in shard
    fresh_out = _ok(client.get(f"/replicas/{fresh}"))
    assert fresh_out["stale"] is False and fresh_out["ready"] is True
    assert _ok(client.get(f"/replicas/{orphan}"))["deployment"] is None

    mine = _ok(client.get("/replicas", params={"deployment": dep["name"]}))["items"]
    assert sorted(r["id"] for r in mine) == sorted([stale, fresh])
    first = _ok(client.get("/replicas", params={"deployment": dep["name"], "limit": 1}))
    second = _ok(
        client.get(
            "/replicas",
            params={"deployment": dep["name"], "limit": 1, "cursor": first["next_cursor"]},
        )
    )
    assert {first["items"][0]["id"], second["items"][0]["id"]} == {stale, fresh}
    assert second["next_cursor"] is None
    _refused(client.get("/replicas/not-a-uuid"), 422, "id")
    _refused(client.get("/replicas/00000000-0000-0000-0000-000000000000"), 404, "id")


# --- actions ----------------------------------------------------------------


def test_actions_newest_first_filtered_and_paged(client: httpx.Client, cp: ControlPlane) -> None:
    dep = name("d")
    for i in range(3):
        sql(
            cp.db_url,
            "INSERT INTO reconcile_actions (epoch, action, deployment, node, reason) "
            "VALUES (1, %s, %s, 'n1', %s)",
            (f"step{i}", dep, f"because {i}"),
        )
    sql(
        cp.db_url,
        "INSERT INTO reconcile_actions (epoch, action, deployment) VALUES (1, 'other', 'x')",
    )
    items = _ok(client.get("/actions", params={"deployment": dep}))["items"]
    assert [a["action"] for a in items] == ["step2", "step1", "step0"]
    page1 = _ok(client.get("/actions", params={"deployment": dep, "limit": 2}))
    page2 = _ok(
        client.get(
            "/actions", params={"deployment": dep, "limit": 2, "cursor": page1["next_cursor"]}
        )
    )
    assert [a["action"] for a in page1["items"] + page2["items"]] == ["step2", "step1", "step0"]
    assert page2["next_cursor"] is None
    _refused(client.get("/actions", params={"limit": 0}), 422, "limit")


# --- GPU classes ------------------------------------------------------------


def test_gpu_classes_crud_and_refusals(client: httpx.Client, cp: ControlPlane) -> None:
    cls = name("h100")
    out = _ok(client.post("/gpu-classes", json={"name": cls, "pattern": "^NVIDIA H100"}), 201)
    assert out["pattern"] == "^NVIDIA H100"
    _refused(client.post("/gpu-classes", json={"name": cls, "pattern": "x"}), 409, "name")
    before = count(cp.db_url, "gpu_classes")
    message = _refused(
        client.post("/gpu-classes", json={"name": name("g"), "pattern": "(["}), 422, "pattern"
    )
    assert "regular expression" in message
    _refused(
        client.post("/gpu-classes", json={"name": name("g"), "pattern": "x" * 513}), 422, "pattern"
    )
    _refused(client.post("/gpu-classes", json={"name": "sim", "pattern": "x"}), 422, "name")
    assert count(cp.db_url, "gpu_classes") == before
    assert _ok(client.patch(f"/gpu-classes/{cls}", json={"pattern": "H100"}))["pattern"] == "H100"
    assert cls in [c["name"] for c in _ok(client.get("/gpu-classes"))["items"]]

    model = name("m")
    _ok(client.post("/models", json={"name": model}), 201)
    profile = name("p")
    _ok(
        client.post(
            "/profiles",
            json={"name": profile, "model": model, "engine": "sim", "model_path": "/m",
                  "gpu_class": cls},
        ),
        201,
    )  # fmt: skip
    assert profile in _refused(client.delete(f"/gpu-classes/{cls}"), 409, "name")
    _ok(client.delete(f"/profiles/{profile}"), 204)
    _ok(client.delete(f"/gpu-classes/{cls}"), 204)
    _refused(client.get(f"/gpu-classes/{cls}"), 404, "name")
    assert _audit_actions(cp, "gpu-class", cls) == ["create", "update", "delete"]


# --- deployments ------------------------------------------------------------


def test_deployment_status_defaults_then_what_the_reconciler_wrote(
    client: httpx.Client, cp: ControlPlane
) -> None:
    _, _, dep = _deployment(client, replicas=3)
    assert dep["generation"] == 1
    assert dep["status"]["replicas"] == 0 and dep["status"]["stalled"] is False
    sql(
        cp.db_url,
        "INSERT INTO deployment_status (deployment_id, observed_generation, replicas, "
        "ready_replicas, updated_replicas, available_replicas, unavailable_replicas, stalled, "
        "reason) SELECT id, 1, 3, 2, 1, 2, 1, true, 'progress deadline 600 s passed' "
        "FROM deployments WHERE name = %s",
        (dep["name"],),
    )
    status = _ok(client.get(f"/deployments/{dep['name']}"))["status"]
    assert status == {
        **status,
        "observed_generation": 1,
        "replicas": 3,
        "ready_replicas": 2,
        "updated_replicas": 1,
        "available_replicas": 2,
        "unavailable_replicas": 1,
        "stalled": True,
        "reason": "progress deadline 600 s passed",
    }
    listed = _ok(client.get("/deployments", params={"limit": 1000}))["items"]
    assert next(d for d in listed if d["name"] == dep["name"])["status"]["ready_replicas"] == 2


def test_scale_suspend_resume_bump_the_generation_and_wake_the_reconciler(
    client: httpx.Client, cp: ControlPlane
) -> None:
    _, _, dep = _deployment(client)
    path = f"/deployments/{dep['name']}"
    with psycopg.connect(libpq(cp.db_url), autocommit=True) as listener:
        listener.execute("LISTEN llmgw_desired_changed")
        out = _ok(client.post(f"{path}/scale", json={"replicas": 5}))
        assert (out["replicas"], out["generation"], out["version"]) == (5, 2, 2)
        notes = [json.loads(n.payload) for n in listener.notifies(timeout=5, stop_after=1)]
    assert notes == [{"kind": "deployment", "name": dep["name"], "action": "scale"}]
    # The same count again changes nothing: no generation, no audit row.
    assert _ok(client.post(f"{path}/scale", json={"replicas": 5}))["generation"] == 2
    assert _ok(client.post(f"{path}/suspend", json={}))["state"] == "suspended"
    resumed = _ok(client.post(f"{path}/resume", json={}))
    assert resumed["state"] == "active" and resumed["generation"] == 4
    _refused(client.post(f"{path}/scale", json={"replicas": -1}), 422, "replicas")
    _refused(client.post(f"{path}/scale", json={"replicas": 1, "replica": 1}), 422, "replica")
    _refused(client.post("/deployments/ghost/scale", json={"replicas": 1}), 404, "name")
    patched = _ok(client.patch(path, json={"version": resumed["version"], "pool": "other"}))
    assert patched["generation"] == 5
    assert _audit_actions(cp, "deployment", dep["name"]) == [
        "create", "scale", "suspend", "resume", "update",
    ]  # fmt: skip


def test_a_fingerprint_change_bumps_the_generation_of_deployments_using_the_profile(
    client: httpx.Client,
) -> None:
    _, profile, dep = _deployment(client)
    p = _ok(client.get(f"/profiles/{profile}"))
    assert p["multinode_backend"] == "ray"
    # A description is not launched: same fingerprint, same generation.
    p = _ok(
        client.patch(f"/profiles/{profile}", json={"version": p["version"], "description": "x"})
    )
    assert _ok(client.get(f"/deployments/{dep['name']}"))["generation"] == 1
    p = _ok(
        client.patch(f"/profiles/{profile}", json={"version": p["version"], "args": ["--x", "1"]})
    )
    after = _ok(client.get(f"/deployments/{dep['name']}"))
    # The deployment's own version is untouched: the admin who read it can still update it.
    assert after["generation"] == 2 and after["version"] == dep["version"]
    _refused(
        client.patch(
            f"/profiles/{profile}", json={"version": p["version"], "multinode_backend": "mpi"}
        ),
        422,
        "multinode_backend",
    )


def test_deleting_a_deployment_keeps_replica_rows(client: httpx.Client, cp: ControlPlane) -> None:
    node_id = insert_node(cp.db_url, name("n"))
    _, _, dep = _deployment(client)
    replica = insert_replica(cp.db_url, dep["name"], [(node_id, [0])])
    _ok(client.delete(f"/deployments/{dep['name']}"), 204)
    rows = sql(
        cp.db_url,
        "SELECT r.deployment_id, r.state, s.desired_state FROM replicas r "
        "JOIN shards s ON s.replica_id = r.id WHERE r.id = %s",
        (replica,),
    )
    assert rows == [(None, "active", "running")]


def test_every_new_route_needs_the_admin_token(cp: ControlPlane, tmp_path: Path) -> None:
    for method, path in [
        ("GET", "/nodes"),
        ("POST", "/nodes/x/cordon"),
        ("POST", "/bootstrap-tokens"),
        ("GET", "/replicas"),
        ("GET", "/actions"),
        ("GET", "/gpu-classes"),
        ("POST", "/apply"),
        ("POST", "/deployments/x/scale"),
    ]:
        r = httpx.request(method, f"{cp.url}/admin/v1{path}", json={})
        assert r.status_code == 401, (method, path, r.text)


def test_multinode_backend_is_stored_and_rolls_a_multi_node_profile(
    client: httpx.Client,
) -> None:
    model, profile = name("m"), name("p")
    _ok(client.post("/models", json={"name": model}), 201)
    body = {"name": profile, "model": model, "engine": "vllm", "model_path": "/m", "tp": 2,
            "nodes": 2, "gpus_per_node": 1}  # fmt: skip
    p = _ok(client.post("/profiles", json=body), 201)
    assert p["multinode_backend"] == "ray"
    dep = _ok(
        client.post("/deployments", json={"name": name("d"), "model": model, "profile": profile}),
        201,
    )
    native = _ok(
        client.patch(
            f"/profiles/{profile}", json={"version": p["version"], "multinode_backend": "native"}
        )
    )
    # Native multi-node launches the engine differently: a new fingerprint, a new generation.
    assert native["multinode_backend"] == "native" and native["fingerprint"] != p["fingerprint"]
    assert _ok(client.get(f"/deployments/{dep['name']}"))["generation"] == 2
