"""`llmgw apply / get / nodes / deployments / tokens` against a real control plane process.

The CLI runs in-process (typer's runner), connected by LLMGW_ADMIN_URL/LLMGW_ADMIN_TOKEN,
over real HTTP to a real `llmgw controlplane` and Postgres.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from tests.controlplane.admin.admin_testkit import (
    ControlPlane,
    count,
    insert_node,
    insert_replica,
    name,
    run_cli,
    sql,
)
from tests.controlplane.agentapi.agentapi_testkit import running_agent_api

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _fleet_yaml(model: str, profile: str, dep: str, *, replicas: int = 1) -> str:
    return f"""\
# A comment and a leading separator are fine.
---
kind: model
name: {model}
description: the demo model
---
kind: profile
name: {profile}
model: {model}
engine: sim
model_path: /models/demo
args: ["--max-num-seqs", "8"]
---
kind: deployment
name: {dep}
model: {model}
profile: {profile}
replicas: {replicas}
---
"""


def _counts(cp: ControlPlane) -> tuple[int, ...]:
    return tuple(count(cp.db_url, t) for t in ("models", "profiles", "deployments", "audit_log"))


def test_apply_create_unchanged_configured_and_dry_run(cp: ControlPlane, tmp_path: Path) -> None:
    model, profile, dep = name("m"), name("p"), name("d")
    f = tmp_path / "fleet.yaml"
    f.write_text(_fleet_yaml(model, profile, dep))

    dry = run_cli(cp, "apply", "-f", str(f), "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert f"model/{model} created (dry run)" in dry.stdout
    assert count(cp.db_url, "models", "name = %s", (model,)) == 0

    first = run_cli(cp, "apply", "-f", str(f))
    assert first.exit_code == 0, first.stderr
    assert first.stdout.splitlines() == [
        f"model/{model} created", f"profile/{profile} created", f"deployment/{dep} created",
    ]  # fmt: skip
    rows = _counts(cp)
    second = run_cli(cp, "apply", "-f", str(f))
    assert second.stdout.splitlines() == [
        f"model/{model} unchanged", f"profile/{profile} unchanged", f"deployment/{dep} unchanged",
    ]  # fmt: skip
    assert _counts(cp) == rows
    versions = sql(
        cp.db_url,
        "SELECT (SELECT version FROM models WHERE name = %s), "
        "(SELECT version FROM profiles WHERE name = %s), "
        "(SELECT version FROM deployments WHERE name = %s)",
        (model, profile, dep),
    )
    assert versions == [(1, 1, 1)]

    f.write_text(_fleet_yaml(model, profile, dep, replicas=4))
    third = run_cli(cp, "apply", "-f", "-", stdin=f.read_text())
    assert third.stdout.splitlines()[2] == f"deployment/{dep} configured", third.stdout
    assert sql(cp.db_url, "SELECT replicas FROM deployments WHERE name = %s", (dep,)) == [(4,)]


def test_apply_lists_every_problem_and_writes_nothing(cp: ControlPlane, tmp_path: Path) -> None:
    model = name("m")
    f = tmp_path / "bad.yaml"
    f.write_text(
        f"""\
kind: model
name: {model}
colour: red
---
kind: profile
name: {name("p")}
model: {model}
engine: vllm
model_path: /m
tp: 3
gpus_per_node: 2
---
kind: deployment
name: {name("d")}
model: missing-model
profile: missing-profile
"""
    )
    rows = _counts(cp)
    result = run_cli(cp, "apply", "-f", str(f))
    assert result.exit_code == 1, (result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 4, result.stderr
    assert "document 1" in errors[0] and "colour" in errors[0]
    assert "document 2" in errors[1] and "gpus_per_node" in errors[1] and "TP 3" in errors[1]
    assert "missing-model" in errors[2] and "missing-profile" in errors[3]
    assert "nothing was applied: 4 problem(s)" in result.stderr
    assert result.stdout == ""
    assert _counts(cp) == rows


def test_dry_run_prints_each_changed_field_and_the_roll(cp: ControlPlane, tmp_path: Path) -> None:
    model, profile, dep = name("m"), name("p"), name("d")
    f = tmp_path / "fleet.yaml"
    f.write_text(_fleet_yaml(model, profile, dep, replicas=4))
    assert run_cli(cp, "apply", "-f", str(f)).exit_code == 0
    old_fp = sql(cp.db_url, "SELECT fingerprint FROM profiles WHERE name = %s", (profile,))[0][0]
    ref = f"file:/run/secrets/{name('hf')}"
    changed = (
        _fleet_yaml(model, profile, dep, replicas=2)
        .replace('"8"]', '"16"]')
        .replace(
            "model_path: /models/demo",
            f"model_path: /models/demo\nsecret_env: {{HF_TOKEN: '{ref}'}}",
        )
    )
    f.write_text(changed)
    rows = _counts(cp)
    dry = run_cli(cp, "apply", "-f", str(f), "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert _counts(cp) == rows
    # A real apply keeps its one line per object, and gets the fingerprint the dry run showed.
    assert run_cli(cp, "apply", "-f", str(f)).stdout.splitlines() == [
        f"model/{model} unchanged", f"profile/{profile} configured", f"deployment/{dep} configured",
    ]  # fmt: skip
    new_fp = sql(cp.db_url, "SELECT fingerprint FROM profiles WHERE name = %s", (profile,))[0][0]
    assert dry.stdout.splitlines() == [
        f"model/{model} unchanged (dry run)",
        f"profile/{profile} configured (dry run)",
        '    args: ["--max-num-seqs", "8"] → ["--max-num-seqs", "16"]',
        "    secret_env.HF_TOKEN: added (value not shown)",
        f"    fingerprint: {old_fp[:12]} → {new_fp[:12]}",
        f"    would roll 2 replicas (deployment {dep})",
        f"deployment/{dep} configured (dry run)",
        "    replicas: 4 → 2",
        "    no roll",
    ], dry.stdout
    assert ref not in dry.stdout


def test_apply_lists_schema_and_reference_problems_in_one_pass(
    cp: ControlPlane, tmp_path: Path
) -> None:
    model = name("m")
    f = tmp_path / "bad.yaml"
    f.write_text(
        f"""\
kind: model
name: {model}
---
kind: profile
name: {name("p")}
model: missing-model
engine: sim
model_path: /m
threds: 4
---
kind: deployment
name: {name("d")}
model: {model}
profile: missing-profile
replica: 2
"""
    )
    rows = _counts(cp)
    result = run_cli(cp, "apply", "-f", str(f))
    assert result.exit_code == 1, (result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 4, result.stderr
    assert errors[0].endswith("unknown field `threds`; did you mean `threads`?"), errors
    assert "document 2" in errors[1] and "model 'missing-model' does not exist" in errors[1]
    assert errors[2].endswith("unknown field `replica`; did you mean `replicas`?"), errors
    assert "document 3" in errors[3] and "profile 'missing-profile' does not exist" in errors[3]
    assert "nothing was applied: 4 problem(s)" in result.stderr
    assert _counts(cp) == rows


def test_apply_refuses_what_is_not_a_fleet_file(cp: ControlPlane, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: model\nname: [unclosed\n")
    result = run_cli(cp, "apply", "-f", str(bad))
    assert result.exit_code == 2 and "not valid YAML at line" in result.stderr
    bad.write_text("- just\n- a list\n")
    result = run_cli(cp, "apply", "-f", str(bad))
    assert result.exit_code == 1 and "not a mapping" in result.stderr
    result = run_cli(cp, "apply", "-f", str(tmp_path / "absent.yaml"))
    assert result.exit_code == 2 and "cannot read" in result.stderr


def test_get_every_kind_as_table_json_and_yaml(cp: ControlPlane, tmp_path: Path) -> None:
    model, profile, dep = name("m"), name("p"), name("d")
    f = tmp_path / "fleet.yaml"
    f.write_text(_fleet_yaml(model, profile, dep))
    assert run_cli(cp, "apply", "-f", str(f)).exit_code == 0
    node = name("n")
    node_id = insert_node(cp.db_url, node, gpus=4)
    replica = insert_replica(cp.db_url, dep, [(node_id, [0])])
    sql(
        cp.db_url,
        "INSERT INTO reconcile_actions (epoch, action, deployment, node, reason) "
        "VALUES (1, 'create_replica', %s, %s, 'scale up 0 -> 1')",
        (dep, node),
    )
    gpu_class = name("h100")
    assert run_cli(cp, "tokens", "create").exit_code == 0
    httpx.post(
        f"{cp.url}/admin/v1/gpu-classes",
        headers=cp.headers,
        json={"name": gpu_class, "pattern": "^NVIDIA H100"},
    ).raise_for_status()

    expect = {
        "models": (model, "NAME"),
        "profiles": (profile, "FINGERPRINT"),
        "deployments": (dep, "READY"),
        "nodes": (node, "GPUS"),
        "replicas": (replica[:7], "SHARDS"),
        "bootstrap-tokens": ("default", "USES LEFT"),
        "gpu-classes": (gpu_class, "PATTERN"),
        "actions": ("create_replica", "REASON"),
    }
    for kind, (needle, header) in expect.items():
        table = run_cli(cp, "get", kind)
        assert table.exit_code == 0, (kind, table.stderr)
        assert header in table.stdout.splitlines()[0] and needle in table.stdout, (
            kind,
            table.stdout,
        )
        as_json = json.loads(run_cli(cp, "get", kind, "-o", "json").stdout)
        as_yaml = yaml.safe_load(run_cli(cp, "get", kind, "-o", "yaml").stdout)
        assert as_json == as_yaml and isinstance(as_json, list) and as_json, kind
    node_line = next(x for x in run_cli(cp, "get", "nodes").stdout.splitlines() if node in x)
    assert "3/4" in node_line  # free/placeable
    one = json.loads(run_cli(cp, "get", "deployment", dep, "-o", "json").stdout)
    assert one["name"] == dep and one["status"]["ready_replicas"] == 0
    rep = yaml.safe_load(run_cli(cp, "get", "replica", replica, "-o", "yaml").stdout)
    assert rep["shards"][0]["node"] == node and rep["stale"] is True
    actions = json.loads(run_cli(cp, "get", "actions", dep, "-o", "json").stdout)
    assert [a["action"] for a in actions] == ["create_replica"]
    missing = run_cli(cp, "get", "deployment", "no-such")
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


def test_nodes_and_deployments_commands(cp: ControlPlane, tmp_path: Path) -> None:
    node = name("n")
    insert_node(cp.db_url, node)
    for verb, column, value in [
        ("cordon", "cordoned", True),
        ("drain", "draining", True),
        ("uncordon", "cordoned", False),
        ("approve", "approval_state", "approved"),
    ]:
        result = run_cli(cp, "nodes", verb, node)
        assert result.exit_code == 0, result.stderr
        assert result.stdout.startswith(f"node/{node} ")
        assert sql(cp.db_url, f"SELECT {column} FROM nodes WHERE name = %s", (node,)) == [(value,)]
    ghost = run_cli(cp, "nodes", "cordon", "ghost-node")
    assert ghost.exit_code == 2 and "ghost-node" in ghost.stderr

    model, profile, dep = name("m"), name("p"), name("d")
    f = tmp_path / "fleet.yaml"
    f.write_text(_fleet_yaml(model, profile, dep))
    assert run_cli(cp, "apply", "-f", str(f)).exit_code == 0
    scaled = run_cli(cp, "deployments", "scale", dep, "3")
    assert scaled.exit_code == 0 and scaled.stdout.strip() == f"deployment/{dep} scaled to 3"
    assert sql(
        cp.db_url, "SELECT replicas, generation FROM deployments WHERE name = %s", (dep,)
    ) == [(3, 2)]
    assert run_cli(cp, "deployments", "suspend", dep).exit_code == 0
    assert sql(cp.db_url, "SELECT state FROM deployments WHERE name = %s", (dep,)) == [
        ("suspended",)
    ]
    assert run_cli(cp, "deployments", "scale", dep, "-1").exit_code == 2


async def test_a_token_made_by_the_cli_registers_a_node(cp: ControlPlane) -> None:
    created = run_cli(
        cp, "tokens", "create", "--pool", "gpu", "--ttl", "2h", "--uses", "1", "--require-approval"
    )
    assert created.exit_code == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("llmgwb_") and "not shown again" in created.stderr
    token_id = token.split("_")[1]
    listed = run_cli(cp, "tokens", "list")
    secret = token.removeprefix(f"llmgwb_{token_id}_")  # the secret itself may hold "_"
    assert token_id in listed.stdout and secret not in listed.stdout

    # The agent API (its own app on the same database) takes the token: the node joins the
    # token's pool, waiting for approval, and the admin API shows what its agent reported.
    node = name("n")
    async with running_agent_api(cp.db_url) as agent_api:
        await agent_api.register(token, node, gpus=2)
        await agent_api.register(token, name("n"), expect=401)  # its one use is spent
    shown = json.loads(run_cli(cp, "get", "node", node, "-o", "json").stdout)
    assert (shown["pool"], shown["approval_state"], shown["free_gpus"]) == ("gpu", "pending", 2)
    assert run_cli(cp, "nodes", "approve", node).exit_code == 0

    revoked = run_cli(cp, "tokens", "revoke", token_id)
    assert (
        revoked.exit_code == 0 and revoked.stdout.strip() == f"bootstrap-token/{token_id} revoked"
    )
    again = run_cli(cp, "tokens", "create", "--ttl", "soon")
    assert again.exit_code == 2 and "--ttl" in again.stderr
    too_long = run_cli(cp, "tokens", "create", "--ttl", "60d")
    assert too_long.exit_code == 2 and "ttl_s" in too_long.stderr


def test_help_texts(cp: ControlPlane) -> None:
    for args in (["apply"], ["nodes"], ["deployments", "scale"], ["tokens", "create"], ["get"]):
        result = run_cli(cp, *args, "--help")
        assert result.exit_code == 0 and "Usage" in result.stdout, args
