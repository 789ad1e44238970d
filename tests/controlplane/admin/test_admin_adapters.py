"""Declared adapters (`kind: adapter`, issue [lora] "Adapters at runtime" step 1) through a real
control plane and Postgres: the routes (create, read, page, update with versions, delete, the
audit rows), their validation, the one namespace they share with models, served names and
profiles' static adapters (409 both ways), a model's delete refused while adapters name it,
`POST /apply` with the other kinds, and `llmgw apply` / `llmgw get adapters`; profiles'
`adapter_slots` through the API and apply, and the read-only `status` of an adapter's placement
through the API, `llmgw get adapters` and `llmgw status`."""

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
    run_cli,
    sql,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _model(client: httpx.Client) -> str:
    m = name("base")
    r = client.post("/models", json={"name": m})
    assert r.status_code == 201, r.text
    return m


def _adapter(client: httpx.Client, model: str, **extra: Any) -> dict[str, Any]:
    body = {"name": name("lora"), "model": model, "path": "/adapters/sql", **extra}
    r = client.post("/adapters", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def _profile(client: httpx.Client, model: str, *adapters: str, served: str = "") -> str:
    p = name("p")
    body = {
        "name": p, "model": model, "engine": "sim", "gpu_class": "sim", "model_path": "/m",
        "served_model_name": served,
        "adapters": [{"name": a, "path": f"/a/{a}"} for a in adapters],
    }  # fmt: skip
    r = client.post("/profiles", json=body)
    assert r.status_code == 201, r.text
    return p


def _audit(cp: ControlPlane, adapter: str) -> list[tuple[Any, ...]]:
    return sql(
        cp.db_url,
        "SELECT action, before, after FROM audit_log WHERE object_kind = 'adapter' "
        "AND object_name = %s ORDER BY id",
        (adapter,),
    )


# --- the routes -----------------------------------------------------------------------


def test_create_read_update_delete_with_versions_and_audit(
    client: httpx.Client, cp: ControlPlane
) -> None:
    model = _model(client)
    # A slash in the name, as models may have one: addressed through {name:path}.
    lora = f"org/{name('lora')}"
    r = client.post(
        "/adapters",
        json={"name": lora, "model": model, "path": "https://hub.example/sql.tar#sha256=" + "a" * 64,
              "min_replicas": 1, "max_replicas": 3, "description": "sql"},
    )  # fmt: skip
    assert r.status_code == 201, r.text
    created = r.json()
    assert {k: created[k] for k in ("name", "model", "min_replicas", "max_replicas", "pinned")} == {
        "name": lora, "model": model, "min_replicas": 1, "max_replicas": 3, "pinned": False,
    }  # fmt: skip
    assert created["version"] == 1 and created["created_at"] and created["updated_at"]
    assert set(created) == {
        "name", "model", "path", "min_replicas", "max_replicas", "pinned", "description",
        "version", "created_at", "updated_at", "status",
    }  # fmt: skip
    # Not placed yet: the leader's count unknown, held nowhere.
    assert created["status"] == {
        "desired_replicas": None, "replicas": [], "loaded": [], "failures": [], "unplaced": "",
    }  # fmt: skip

    got = client.get(f"/adapters/{lora}")
    assert got.status_code == 200 and got.json() == created

    # Update with the version read; nulls set the bounds back to the default.
    r = client.patch(f"/adapters/{lora}", json={"version": 1, "pinned": True, "max_replicas": None})
    assert r.status_code == 200, r.text
    assert (r.json()["pinned"], r.json()["max_replicas"], r.json()["min_replicas"]) == (
        True, None, 1,
    )  # fmt: skip
    assert r.json()["version"] == 2
    # Absent fields stay as they are (min_replicas above; path here).
    assert r.json()["path"] == created["path"]
    # The same request again (a retry after a lost reply): same outcome, no new version.
    again = client.patch(
        f"/adapters/{lora}", json={"version": 1, "pinned": True, "max_replicas": None}
    )
    assert again.status_code == 200 and again.json()["version"] == 2
    # A real change on a stale version: 409 naming the version, nothing written.
    stale = client.patch(f"/adapters/{lora}", json={"version": 1, "path": "/adapters/other"})
    assert stale.status_code == 409, stale.text
    error = stale.json()["error"]
    assert error["code"] == "conflict" and error["field"] == "version"
    assert "version 2" in error["message"] and "version 1" in error["message"]
    assert client.get(f"/adapters/{lora}").json()["path"] == created["path"]
    # The base model cannot change: another base is another adapter.
    moved = client.patch(f"/adapters/{lora}", json={"version": 2, "model": _model(client)})
    assert moved.status_code == 422 and "model" in moved.json()["error"]["message"]

    assert client.delete(f"/adapters/{lora}").status_code == 204
    assert client.get(f"/adapters/{lora}").status_code == 404
    missing = client.delete(f"/adapters/{lora}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not-found"
    assert "GET /admin/v1/adapters" in missing.json()["error"]["message"]

    rows = _audit(cp, lora)
    assert [a for a, _, _ in rows] == ["create", "update", "delete"]
    assert rows[0][1] is None and rows[0][2]["path"] == created["path"]
    assert rows[1][1]["pinned"] is False and rows[1][2]["pinned"] is True
    assert rows[2][1]["pinned"] is True and rows[2][2] is None


def test_list_is_paged_in_name_order(client: httpx.Client) -> None:
    model = _model(client)
    mine = sorted(_adapter(client, model)["name"] for _ in range(3))
    seen: list[str] = []
    cursor: str | None = None
    for _ in range(100):
        params: dict[str, Any] = {"limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = client.get("/adapters", params=params).json()
        assert len(page["items"]) <= 2
        seen += [a["name"] for a in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == sorted(seen) and [n for n in seen if n in mine] == mine


def test_a_duplicate_is_409_and_a_missing_model_404(client: httpx.Client) -> None:
    model = _model(client)
    a = _adapter(client, model)
    r = client.post("/adapters", json={"name": a["name"], "model": model, "path": "/x"})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["field"] == "name" and "PATCH /admin/v1/adapters/" in r.text
    r = client.post("/adapters", json={"name": name("lora"), "model": "no-such", "path": "/x"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "model", r.text


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"path": ""}, "path", "at least 1 character"),
        ({"path": "/" + "x" * 4096}, "path", "4096"),
        ({"path": "/a\x00b"}, "path", "NUL"),
        ({"min_replicas": -1}, "min_replicas", "greater than or equal to 0"),
        ({"max_replicas": 0}, "max_replicas", "greater than or equal to 1"),
        ({"min_replicas": "2"}, "min_replicas", "integer"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas", "give max_replicas >= min"),
        ({"pinned": "yes"}, "pinned", "boolean"),
        ({"name": "bad name"}, "name", "pattern"),
        ({"colour": "red"}, "colour", "unknown field"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(
    client: httpx.Client, cp: ControlPlane, extra: dict[str, Any], field: str, words: str
) -> None:
    body = {"name": name("lora"), "model": _model(client), "path": "/adapters/x", **extra}
    rows = count(cp.db_url, "adapters")
    r = client.post("/adapters", json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == field and words in error["message"], error
    assert count(cp.db_url, "adapters") == rows


def test_an_update_is_checked_against_the_stored_bound(client: httpx.Client) -> None:
    a = _adapter(client, _model(client), min_replicas=2)
    path = f"/adapters/{a['name']}"
    r = client.patch(path, json={"version": 1, "max_replicas": 1})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "max_replicas"
    assert "max_replicas 1 is below min_replicas 2" in r.json()["error"]["message"]
    r = client.patch(path, json={"version": 1, "min_replicas": -1})
    assert r.status_code == 422 and r.json()["error"]["field"] == "min_replicas"
    # Both moved together are fine, and null min lets any max stand.
    r = client.patch(path, json={"version": 1, "min_replicas": None, "max_replicas": 1})
    assert r.status_code == 200, r.text
    assert (r.json()["min_replicas"], r.json()["max_replicas"]) == (None, 1)


# --- one namespace ---------------------------------------------------------------------


def test_an_adapter_may_not_take_a_name_held_by_a_model_served_name_or_static_adapter(
    client: httpx.Client,
) -> None:
    model, other = _model(client), _model(client)
    static, served = name("static"), name("served")
    holder = _profile(client, model, static)
    server = _profile(client, other, served=served)
    cases = [
        (other, f"model {other!r}", "delete the model"),
        (served, f"the served name of profile {server!r}", "served_model_name"),
        (static, f"a static adapter of profile {holder!r}", "`adapters`"),
    ]
    for taken, holder_words, fix in cases:
        r = client.post("/adapters", json={"name": taken, "model": model, "path": "/a"})
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "conflict" and error["field"] == "name"
        assert f"adapter name {taken!r} is taken by {holder_words}" in error["message"], error
        assert "another name" in error["message"] and fix in error["message"], error
        assert client.get(f"/adapters/{taken}").status_code == 404


def test_a_declared_adapter_holds_its_name_against_models_and_profiles(
    client: httpx.Client,
) -> None:
    model = _model(client)
    lora = _adapter(client, model)["name"]
    # A model named like it.
    r = client.post("/models", json={"name": lora})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["field"] == "name"
    assert f"model name {lora!r} is taken by adapter {lora!r}" in r.json()["error"]["message"]
    assert f"DELETE /admin/v1/adapters/{lora}" in r.json()["error"]["message"]
    # A profile's static adapter named like it, on the same model or another.
    for base in (model, _model(client)):
        body = {
            "name": name("p"), "model": base, "engine": "sim", "model_path": "/m",
            "adapters": [{"name": "fine", "path": "/a"}, {"name": lora, "path": "/a"}],
        }  # fmt: skip
        r = client.post("/profiles", json=body)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["field"] == "adapters.1.name"
        assert "declared with `kind: adapter`" in r.json()["error"]["message"]
    # A profile served under its name.
    r = client.post(
        "/profiles",
        json={"name": name("p"), "model": model, "engine": "sim", "model_path": "/m",
              "served_model_name": lora},
    )  # fmt: skip
    assert r.status_code == 409 and r.json()["error"]["field"] == "served_model_name", r.text
    # ... and an existing profile patched to list it.
    p = _profile(client, model)
    r = client.patch(
        f"/profiles/{p}", json={"version": 1, "adapters": [{"name": lora, "path": "/a"}]}
    )
    assert r.status_code == 409 and r.json()["error"]["field"] == "adapters.0.name", r.text
    # Deleted, the name is free again.
    assert client.delete(f"/adapters/{lora}").status_code == 204
    assert client.post("/models", json={"name": lora}).status_code == 201


def test_a_model_with_adapters_cannot_be_deleted(client: httpx.Client, cp: ControlPlane) -> None:
    model = _model(client)
    a, b = sorted(_adapter(client, model)["name"] for _ in range(2))
    r = client.delete(f"/models/{model}")
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert f"model {model!r} is in use by adapter(s) {a!r}, {b!r}" in message
    assert "delete those first" in message
    assert count(cp.db_url, "models", "name = %s", (model,)) == 1
    for n in (a, b):
        assert client.delete(f"/adapters/{n}").status_code == 204
    assert client.delete(f"/models/{model}").status_code == 204


def test_writes_notify_the_route_caches_and_the_reconciler(
    client: httpx.Client, cp: ControlPlane
) -> None:
    model = _model(client)
    with psycopg.connect(libpq(cp.db_url), autocommit=True) as conn:
        conn.execute("LISTEN llmgw_routes_changed")
        conn.execute("LISTEN llmgw_desired_changed")
        lora = _adapter(client, model)["name"]
        got: dict[str, list[str]] = {}
        for n in conn.notifies(timeout=5, stop_after=2):
            got.setdefault(n.channel, []).append(n.payload)
    assert got.get("llmgw_routes_changed") == ["adapters"], got
    [payload] = got["llmgw_desired_changed"]
    assert json.loads(payload) == {"kind": "adapter", "name": lora, "action": "create"}


# --- apply -----------------------------------------------------------------------------


def _docs(model: str, profile: str, lora: str, **adapter: Any) -> list[dict[str, Any]]:
    # Out of dependency order: the adapter comes before its model.
    return [
        {"kind": "adapter", "name": lora, "model": model, "path": "/adapters/sql", **adapter},
        {"kind": "model", "name": model},
        {"kind": "profile", "name": profile, "model": model, "engine": "sim",
         "model_path": "/models/demo", "adapters": [{"name": f"{lora}-static", "path": "/s"}]},
    ]  # fmt: skip


def _results(r: httpx.Response) -> list[tuple[int, str, str]]:
    assert r.status_code == 200, r.text
    return [(x["index"], x["kind"], x["result"]) for x in r.json()["results"]]


def test_apply_creates_diffs_and_dry_runs_adapters(client: httpx.Client, cp: ControlPlane) -> None:
    model, profile, lora = name("m"), name("p"), name("lora")
    docs = _docs(model, profile, lora)
    dry = client.post("/apply", json={"documents": docs, "dry_run": True})
    assert _results(dry) == [(0, "adapter", "created"), (1, "model", "created"),
                             (2, "profile", "created")]  # fmt: skip
    assert count(cp.db_url, "adapters", "name = %s", (lora,)) == 0

    assert _results(client.post("/apply", json={"documents": docs})) == [
        (0, "adapter", "created"), (1, "model", "created"), (2, "profile", "created"),
    ]  # fmt: skip
    assert client.get(f"/adapters/{lora}").json()["model"] == model
    # The profile's static adapter is untouched by the declared one.
    assert client.get(f"/profiles/{profile}").json()["adapters"] == [
        {"name": f"{lora}-static", "path": "/s"}
    ]
    audit = count(cp.db_url, "audit_log")
    assert _results(client.post("/apply", json={"documents": docs})) == [
        (0, "adapter", "unchanged"), (1, "model", "unchanged"), (2, "profile", "unchanged"),
    ]  # fmt: skip
    assert count(cp.db_url, "audit_log") == audit

    changed = _docs(model, profile, lora, max_replicas=4, pinned=True)
    dry = client.post("/apply", json={"documents": changed, "dry_run": True})
    assert _results(dry)[0] == (0, "adapter", "configured")
    result = dry.json()["results"][0]
    assert result["changes"] == [
        {"field": "max_replicas", "change": "changed", "old": None, "new": 4, "secret": False},
        {"field": "pinned", "change": "changed", "old": False, "new": True, "secret": False},
    ]
    assert result["rolls"] == 0
    assert client.get(f"/adapters/{lora}").json()["version"] == 1
    assert _results(client.post("/apply", json={"documents": changed}))[0][2] == "configured"
    stored = client.get(f"/adapters/{lora}").json()
    assert (stored["max_replicas"], stored["pinned"], stored["version"]) == (4, True, 2)
    # Declarative: an omitted field takes its default again.
    assert _results(client.post("/apply", json={"documents": docs}))[0][2] == "configured"
    assert client.get(f"/adapters/{lora}").json()["max_replicas"] is None


def test_apply_refuses_bad_adapter_documents_and_writes_nothing(
    client: httpx.Client, cp: ControlPlane
) -> None:
    model = _model(client)
    lora = _adapter(client, model)["name"]
    other = _model(client)
    rows = count(cp.db_url, "adapters"), count(cp.db_url, "models")
    docs = [
        {"kind": "adapter", "name": name("lora"), "model": "missing-model", "path": "/a"},
        {"kind": "adapter", "name": name("lora"), "model": model, "path": "",
         "min_replicas": 5, "max_replicas": 1},
        # An adapter cannot move to another base model.
        {"kind": "adapter", "name": lora, "model": other, "path": "/a"},
        {"kind": "adapter", "name": name("lora"), "model": model, "pth": "/a"},
        {"kind": "adaptr", "name": name("lora")},
    ]  # fmt: skip
    r = client.post("/apply", json={"documents": docs})
    assert r.status_code == 422, r.text
    problems = r.json()["error"]["problems"]
    assert [(p["index"], p["field"]) for p in problems] == [
        (0, "model"), (1, "path"), (1, "max_replicas"), (2, "model"), (3, "path"), (3, "pth"),
        (4, "kind"),
    ], problems  # fmt: skip
    message = {(p["index"], p["field"]): p["message"] for p in problems}
    assert "kind: model" in message[0, "model"]
    assert "below min_replicas 5" in message[1, "max_replicas"]
    assert "cannot move to another model" in message[2, "model"]
    assert message[3, "pth"] == "unknown field `pth`; did you mean `path`?"
    assert "did you mean `adapter`?" in message[4, "kind"]
    assert (count(cp.db_url, "adapters"), count(cp.db_url, "models")) == rows


def test_apply_checks_the_namespace_with_adapters_both_ways(
    client: httpx.Client, cp: ControlPlane
) -> None:
    model = _model(client)
    stored = _adapter(client, model)["name"]
    taken = name("taken")
    docs = [
        # A model named like a stored adapter document.
        {"kind": "model", "name": stored},
        # An adapter document and a model of the same batch under one name: both named.
        {"kind": "model", "name": taken},
        {"kind": "adapter", "name": taken, "model": model, "path": "/a"},
        # A static adapter named like a stored adapter document.
        {"kind": "profile", "name": name("p"), "model": model, "engine": "sim",
         "model_path": "/m", "adapters": [{"name": stored, "path": "/a"}]},
    ]  # fmt: skip
    rows = count(cp.db_url, "models")
    r = client.post("/apply", json={"documents": docs})
    assert r.status_code == 409, r.text
    problems = r.json()["error"]["problems"]
    assert sorted((p["index"], p["field"]) for p in problems) == [
        (0, "name"), (1, "name"), (2, "name"), (3, "adapters.0.name"),
    ], problems  # fmt: skip
    assert count(cp.db_url, "models") == rows


# --- the CLI ---------------------------------------------------------------------------


def test_cli_apply_and_get_adapters(cp: ControlPlane, tmp_path: Path) -> None:
    model, profile, lora = name("m"), name("p"), f"org/{name('lora')}"
    f = tmp_path / "fleet.yaml"
    f.write_text(
        f"""\
kind: adapter
name: {lora}
model: {model}
path: /adapters/sql
min_replicas: 1
max_replicas: 2
pinned: true
description: text to SQL
---
kind: model
name: {model}
---
kind: profile
name: {profile}
model: {model}
engine: sim
model_path: /models/demo
adapters:
  - name: {name("static")}
    path: /adapters/static
"""
    )
    first = run_cli(cp, "apply", "-f", str(f))
    assert first.exit_code == 0, first.stderr
    assert first.stdout.splitlines() == [
        f"adapter/{lora} created", f"model/{model} created", f"profile/{profile} created",
    ]  # fmt: skip
    second = run_cli(cp, "apply", "-f", str(f), "--dry-run")
    assert f"adapter/{lora} unchanged (dry run)" in second.stdout.splitlines()

    f.write_text(f.read_text().replace("max_replicas: 2", "max_replicas: 3"))
    dry = run_cli(cp, "apply", "-f", str(f), "--dry-run")
    lines = dry.stdout.splitlines()
    at = lines.index(f"adapter/{lora} configured (dry run)")
    # A field's change, and no roll line: an adapter document rolls nothing.
    assert lines[at + 1] == "    max_replicas: 2 → 3", lines
    assert not lines[at + 2].startswith("    "), lines

    table = run_cli(cp, "get", "adapters")
    assert table.exit_code == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split() == [
        "NAME", "MODEL", "PATH", "MIN", "MAX", "PINNED", "DESIRED/LOADED", "DESCRIPTION",
    ]  # fmt: skip
    [row] = [r for r in rows if r.startswith(lora + " ")]
    assert row.split() == [
        lora, model, "/adapters/sql", "1", "2", "True", "-/0", "text", "to", "SQL",
    ]  # fmt: skip

    one = run_cli(cp, "get", "adapter", lora, "-o", "json")
    assert one.exit_code == 0, one.stderr
    assert json.loads(one.stdout)["name"] == lora and json.loads(one.stdout)["pinned"] is True


# --- runtime placement: profile slots and the adapter's status -------------------------


def test_profile_adapter_slots_round_trip_through_the_api(client: httpx.Client) -> None:
    model = _model(client)
    p = name("p")
    body = {"name": p, "model": model, "engine": "sim", "gpu_class": "sim", "model_path": "/m"}
    r = client.post("/profiles", json={**body, "adapter_slots": 4})
    assert r.status_code == 201, r.text
    assert r.json()["adapter_slots"] == 4
    assert client.get(f"/profiles/{p}").json()["adapter_slots"] == 4
    fingerprint = r.json()["fingerprint"]
    r = client.patch(f"/profiles/{p}", json={"version": 1, "adapter_slots": 16})
    assert r.status_code == 200, r.text
    assert (r.json()["adapter_slots"], r.json()["version"]) == (16, 2)
    # It reaches the engine's command (its slot flags): the fingerprint moves, so replicas
    # roll onto engines started with the new slots.
    assert r.json()["fingerprint"] != fingerprint
    # Absent: as it is.
    r = client.patch(f"/profiles/{p}", json={"version": 2, "description": "x"})
    assert r.json()["adapter_slots"] == 16
    # Out of range, either way: 422 naming the field, nothing written.
    for bad in (-1, 1025, "4"):
        r = client.patch(f"/profiles/{p}", json={"version": 3, "adapter_slots": bad})
        assert r.status_code == 422, r.text
        assert "adapter_slots" in r.text
    # A profile that says nothing has none.
    q = name("p")
    r = client.post("/profiles", json={**body, "name": q})
    assert r.status_code == 201 and r.json()["adapter_slots"] == 0
    # An engine that loads adapters only at start refuses slots, naming the field.
    gguf = {**body, "name": name("p"), "engine": "llamacpp", "gpu_class": "h100",
            "model_path": "/m/x.gguf", "adapter_slots": 2}  # fmt: skip
    r = client.post("/profiles", json=gguf)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "adapter_slots"


def test_apply_sets_and_diffs_a_profiles_adapter_slots(cp: ControlPlane, tmp_path: Path) -> None:
    model, profile = name("m"), name("p")
    f = tmp_path / "fleet.yaml"
    doc = f"""\
kind: model
name: {model}
---
kind: profile
name: {profile}
model: {model}
engine: sim
gpu_class: sim
model_path: /models/demo
adapter_slots: 2
"""
    f.write_text(doc)
    first = run_cli(cp, "apply", "-f", str(f))
    assert first.exit_code == 0, first.stderr
    assert sql(cp.db_url, "SELECT adapter_slots FROM profiles WHERE name = %s", (profile,)) == [
        (2,)
    ]
    f.write_text(doc.replace("adapter_slots: 2", "adapter_slots: 8"))
    dry = run_cli(cp, "apply", "-f", str(f), "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert "    adapter_slots: 2 → 8" in dry.stdout.splitlines(), dry.stdout
    applied = run_cli(cp, "apply", "-f", str(f))
    assert applied.exit_code == 0, applied.stderr
    assert sql(cp.db_url, "SELECT adapter_slots FROM profiles WHERE name = %s", (profile,)) == [
        (8,)
    ]


def _holder(cp: ControlPlane, deployment: str, desired: list[str], observed: list[Any]) -> str:
    """A ready replica of ``deployment`` on a node of its own whose shard is told to hold
    ``desired`` and reports ``observed``; returns the replica's id."""
    node = name("n")
    node_id = insert_node(cp.db_url, node, gpus=1)
    replica = insert_replica(cp.db_url, deployment, [(node_id, [0])])
    sql(
        cp.db_url,
        "UPDATE shards SET desired_adapters = %s, observed_adapters = %s WHERE replica_id = %s",
        (
            json.dumps([{"name": a, "path": "/a", "pinned": False} for a in desired]),
            json.dumps(observed),
            replica,
        ),
    )
    return str(replica)


def test_status_says_where_an_adapter_is_desired_loaded_and_failing(
    client: httpx.Client, cp: ControlPlane
) -> None:
    model = _model(client)
    profile = _profile(client, model)
    dep = name("d")
    r = client.post("/deployments", json={"name": dep, "model": model, "profile": profile})
    assert r.status_code == 201, r.text
    lora = _adapter(client, model)["name"]
    other = _adapter(client, model)["name"]
    # What the leader and the agents write: a count, a reason, two holders, one failing.
    sql(
        cp.db_url,
        "INSERT INTO adapter_status (adapter, desired_replicas, unplaced) VALUES (%s, 3, %s)",
        (lora, "only 2 of the 3 replicas of model m that can hold it are ready"),
    )
    ok = _holder(cp, dep, [lora], [{"name": lora, "state": "loaded", "reason": "", "failures": 0}])
    bad = _holder(
        cp, dep, [lora], [{"name": lora, "state": "failed", "reason": "no such dir", "failures": 2}]
    )
    got = client.get(f"/adapters/{lora}").json()["status"]
    assert got["desired_replicas"] == 3
    assert got["unplaced"] == "only 2 of the 3 replicas of model m that can hold it are ready"
    assert sorted(h["replica"] for h in got["replicas"]) == sorted([ok, bad])
    assert [h["replica"] for h in got["loaded"]] == [ok]
    [failure] = got["failures"]
    assert (failure["replica"], failure["reason"], failure["failures"]) == (bad, "no such dir", 2)
    assert failure["node"]
    # The list answers with the same status; one placed nowhere has the empty one.
    items = {a["name"]: a for a in client.get("/adapters", params={"limit": 200}).json()["items"]}
    assert items[lora]["status"] == got
    assert items[other]["status"]["desired_replicas"] is None
    # Read-only: a PATCH cannot write it (unknown fields are refused).
    r = client.patch(f"/adapters/{lora}", json={"version": 1, "status": {"desired_replicas": 9}})
    assert r.status_code == 422, r.text

    table = run_cli(cp, "get", "adapters", lora)
    assert table.exit_code == 0, table.stderr
    assert table.stdout.splitlines()[1].split()[6] == "3/1"
    screen = run_cli(cp, "status")
    assert screen.exit_code == 0, screen.stderr
    lines = screen.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("ADAPTERS ("))
    section = lines[at : lines.index("", at)]
    rows = [line for line in section if line.split()[:1] == [lora]]
    assert len(rows) == 1, screen.stdout
    row = rows[0]
    assert row.split()[1:5] == [model, "3", "2", "1"], row
    assert "only 2 of the 3" in row
    data = json.loads(run_cli(cp, "status", "--json").stdout)
    [mine] = [a for a in data["adapters"] if a["name"] == lora]
    assert (mine["desired"], mine["replicas"], mine["loaded"]) == (3, 2, 1)
    assert mine["failures"] == [
        {"replica": bad, "node": failure["node"], "reason": "no such dir", "failures": 2}
    ]
