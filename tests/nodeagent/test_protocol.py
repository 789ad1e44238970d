"""The agent protocol's wire models: version skew tolerated, everything bounded, secrets hidden."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from llmgw.protocol import (
    KV_PATH,
    MAX_LOG_TAIL_CHARS,
    MAX_SHARDS,
    PROTOCOL_VERSION,
    REGISTER_PATH,
    SYNC_PATH,
    DesiredShard,
    NodeInventory,
    RegisterRequest,
    RegisterResponse,
    ShardBinding,
    SyncRequest,
    SyncResponse,
)


def test_paths_and_version() -> None:
    assert (REGISTER_PATH, SYNC_PATH, KV_PATH) == (
        "/agent/v1/register",
        "/agent/v1/sync",
        "/agent/v1/kv",
    )
    assert PROTOCOL_VERSION == 1


def test_unknown_fields_from_a_newer_peer_are_ignored() -> None:
    body = {
        "cluster_id": "c",
        "instance_id": "i",
        "desired_version": "7",
        "shards": [
            {
                "shard_id": "s",
                "replica_id": "r",
                "spec": {"anything": 1},
                "a_field_from_the_future": {"x": 1},
            }
        ],
        "another_new_field": True,
    }
    resp = SyncResponse.model_validate_json(json.dumps(body))
    assert resp.shards is not None and resp.shards[0].shard_id == "s"
    b = ShardBinding.model_validate({"shard_id": "s", "observed_state": "ready", "new": 1})
    assert b.observed_state == "ready"


def test_lists_and_strings_are_bounded() -> None:
    shard = {"shard_id": "s", "replica_id": "r", "spec": {}}
    with pytest.raises(ValidationError):
        SyncResponse.model_validate({"cluster_id": "c", "shards": [shard] * (MAX_SHARDS + 1)})
    with pytest.raises(ValidationError):
        ShardBinding(shard_id="s", observed_state="failed", log_tail="x" * (MAX_LOG_TAIL_CHARS + 1))
    with pytest.raises(ValidationError):
        ShardBinding(shard_id="s" * 1000, observed_state="ready")
    with pytest.raises(ValidationError):
        ShardBinding(shard_id="s", observed_state="sleeping")  # type: ignore[arg-type]


def test_secrets_never_show_in_repr() -> None:
    reg = RegisterRequest(
        bootstrap_token="tok-secret-123",
        node_name="n",
        mgmt_addr="10.0.0.1",
        inventory=NodeInventory(),
    )
    resp = RegisterResponse(
        node_id="n1", node_credential="cred-secret-456", cluster_id="c", approval_state="approved"
    )
    shard = DesiredShard(shard_id="s", replica_id="r", spec={}, engine_api_key="key-secret-789")
    for model, secret in (
        (reg, "tok-secret-123"),
        (resp, "cred-secret-456"),
        (shard, "key-secret-789"),
    ):
        assert secret not in repr(model) and secret not in str(model)
        # ...but they do travel on the wire, where they are meant to.
        assert secret in model.model_dump_json()


def test_sync_request_round_trips() -> None:
    req = SyncRequest(
        node_id="n1",
        agent_epoch=5,
        seq=2,
        desired_version=None,
        bindings=(ShardBinding(shard_id="s", observed_state="starting", http_port=20000),),
    )
    assert SyncRequest.model_validate_json(req.model_dump_json()) == req


def test_protocol_imports_neither_side() -> None:
    import ast
    from pathlib import Path

    import llmgw.protocol

    root = Path(llmgw.protocol.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("llmgw.nodeagent", "llmgw.controlplane")), path


def test_nodeagent_never_imports_the_control_plane() -> None:
    import ast
    from pathlib import Path

    import llmgw.nodeagent

    root = Path(llmgw.nodeagent.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert not any(n.startswith("llmgw.controlplane") for n in names), path


def test_the_supervisor_diff_is_pure() -> None:
    """diff.py is the agent's pure core (style guide §2): standard library types only."""
    import ast
    from pathlib import Path

    import llmgw.nodeagent.diff as diff

    tree = ast.parse(Path(diff.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert imported <= {"__future__", "collections.abc", "dataclasses", "typing"}, imported
    assert "environ" not in Path(diff.__file__).read_text()
