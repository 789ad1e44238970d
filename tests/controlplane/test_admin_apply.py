"""POST /admin/v1/apply against a real control plane: all or nothing, every problem listed,
created / configured / unchanged, dry runs that write nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from admin_testkit import ControlPlane, count, name, running_controlplane, sql
from pg_harness import PgServer

pytestmark = pytest.mark.timeout(60)

_TABLES = ("models", "profiles", "deployments", "audit_log")


@pytest.fixture(scope="module")
def cp(
    pg_server: PgServer, _pg_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    with running_controlplane(pg_server, _pg_template, tmp_path_factory.mktemp("cp")) as c:
        yield c


@pytest.fixture
def client(cp: ControlPlane) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{cp.url}/admin/v1", headers=cp.headers, timeout=10) as c:
        yield c


def _docs(model: str, profile: str, dep: str, **profile_extra: Any) -> list[dict[str, Any]]:
    # Deliberately out of dependency order: the deployment comes first.
    return [
        {"kind": "deployment", "name": dep, "model": model, "profile": profile, "replicas": 2},
        {"kind": "model", "name": model, "description": "demo"},
        {"kind": "profile", "name": profile, "model": model, "engine": "sim",
         "model_path": "/models/demo", **profile_extra},
    ]  # fmt: skip


def _rows(cp: ControlPlane) -> dict[str, int]:
    return {t: count(cp.db_url, t) for t in _TABLES}


def _apply(client: httpx.Client, docs: list[dict[str, Any]], dry_run: bool = False) -> Any:
    r = client.post("/apply", json={"documents": docs, "dry_run": dry_run})
    assert r.status_code == 200, r.text
    return [(x["index"], x["kind"], x["result"]) for x in r.json()["results"]]


def test_create_then_unchanged_then_configured(client: httpx.Client, cp: ControlPlane) -> None:
    model, profile, dep = name("m"), name("p"), name("d")
    docs = _docs(model, profile, dep)
    assert _apply(client, docs) == [
        (0, "deployment", "created"), (1, "model", "created"), (2, "profile", "created"),
    ]  # fmt: skip
    stored = client.get(f"/profiles/{profile}").json()
    rows = _rows(cp)
    assert _apply(client, docs) == [
        (0, "deployment", "unchanged"), (1, "model", "unchanged"), (2, "profile", "unchanged"),
    ]  # fmt: skip
    # No version bump, no audit row, and the cluster seed the profile got is kept.
    assert _rows(cp) == rows
    again = client.get(f"/profiles/{profile}").json()
    assert (again["version"], again["kv_hash_seed"]) == (stored["version"], stored["kv_hash_seed"])

    changed = _docs(model, profile, dep, args=["--max-num-seqs", "8"])
    assert _apply(client, changed) == [
        (0, "deployment", "unchanged"), (1, "model", "unchanged"), (2, "profile", "configured"),
    ]  # fmt: skip
    p = client.get(f"/profiles/{profile}").json()
    assert p["version"] == stored["version"] + 1 and p["fingerprint"] != stored["fingerprint"]
    # A new fingerprint is a new spec for the deployment: its generation moved, its version not.
    d = client.get(f"/deployments/{dep}").json()
    assert (d["generation"], d["version"]) == (2, 1)
    changed[0]["replicas"] = 3
    assert _apply(client, changed)[0] == (0, "deployment", "configured")
    d = client.get(f"/deployments/{dep}").json()
    assert (d["replicas"], d["generation"], d["version"]) == (3, 3, 2)
    actions = sql(
        cp.db_url,
        "SELECT action FROM audit_log WHERE object_name = %s ORDER BY id",
        (dep,),
    )
    assert [a[0] for a in actions] == ["create", "update"]


def test_dry_run_reports_and_writes_nothing(client: httpx.Client, cp: ControlPlane) -> None:
    model, profile, dep = name("m"), name("p"), name("d")
    rows = _rows(cp)
    results = _apply(client, _docs(model, profile, dep), dry_run=True)
    assert [r[2] for r in results] == ["created"] * 3
    assert _rows(cp) == rows
    assert client.get(f"/models/{model}").status_code == 404


def test_every_problem_is_listed_and_nothing_is_written(
    client: httpx.Client, cp: ControlPlane
) -> None:
    existing_model = name("m")
    _apply(client, [{"kind": "model", "name": existing_model}])
    rows = _rows(cp)
    good_model = name("m")
    docs = [
        {"kind": "model", "name": good_model},  # fine alone: must not be written either
        {"kind": "model", "name": name("m"), "colour": "red"},
        {"kind": "profile", "name": name("p"), "model": good_model, "engine": "sim",
         "model_path": "/m", "tp": 3, "gpus_per_node": 2},
        {"kind": "profile", "name": name("p"), "model": "no-such-model", "engine": "vllm",
         "model_path": "/m"},
        {"kind": "deployment", "name": name("d"), "model": good_model, "profile": "nope"},
        {"kind": "gateway", "name": "x"},
        {"kind": "profile", "name": name("p"), "model": good_model, "engine": "sim",
         "model_path": "/m", "env": {"LD_PRELOAD": "/evil.so"}, "replicas": 2},
        {"kind": "model", "name": good_model},
    ]  # fmt: skip
    r = client.post("/apply", json={"documents": docs})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "spec-invalid" and "nothing was applied" in error["message"]
    got = {(p["index"], p["field"]) for p in error["problems"]}
    assert got == {
        (1, "colour"),
        (2, "gpus_per_node"),
        (3, "model"),
        (4, "profile"),
        (5, "kind"),
        (6, "replicas"),
        (7, "name"),
    }, error["problems"]
    by_index = {p["index"]: p for p in error["problems"]}
    assert "3" in by_index[2]["message"] and by_index[2]["kind"] == "profile"
    assert "no-such-model" in by_index[3]["message"]
    assert _rows(cp) == rows


def test_engine_problems_reported_next_to_schema_problems(client: httpx.Client) -> None:
    model = name("m")
    docs = [
        {"kind": "model", "name": model},
        {"kind": "profile", "name": name("p"), "model": model, "engine": "sim",
         "model_path": "/m", "env": {"LD_PRELOAD": "/evil.so"}},
        {"kind": "profile", "name": name("p"), "model": model, "engine": "warp-drive",
         "model_path": "/m"},
    ]  # fmt: skip
    r = client.post("/apply", json={"documents": docs})
    problems = r.json()["error"]["problems"]
    assert [p["index"] for p in problems] == [1, 2], problems
    assert "LD_PRELOAD" in problems[0]["message"]
    assert "warp-drive" in problems[1]["message"] and "sim" in problems[1]["message"]


def test_objects_cannot_move_to_another_model(client: httpx.Client, cp: ControlPlane) -> None:
    m1, m2, profile, dep = name("m"), name("m"), name("p"), name("d")
    _apply(client, [*_docs(m1, profile, dep), {"kind": "model", "name": m2}])
    rows = _rows(cp)
    moved = [
        {"kind": "profile", "name": profile, "model": m2, "engine": "sim", "model_path": "/m"},
        {"kind": "deployment", "name": dep, "model": m2, "profile": profile},
    ]
    r = client.post("/apply", json={"documents": moved})
    fields = [(p["index"], p["field"]) for p in r.json()["error"]["problems"]]
    assert fields == [(0, "model"), (1, "model")], r.text
    # A deployment naming a profile of another model (one both in the database).
    other = name("p")
    _apply(
        client,
        [{"kind": "profile", "name": other, "model": m2, "engine": "sim", "model_path": "/m"}],
    )
    rows = _rows(cp)
    r = client.post(
        "/apply",
        json={"documents": [{"kind": "deployment", "name": dep, "model": m1, "profile": other}]},
    )
    problems = r.json()["error"]["problems"]
    assert [(p["field"], m2 in p["message"]) for p in problems] == [("profile", True)]
    assert _rows(cp) == rows


def test_apply_body_bounds(client: httpx.Client) -> None:
    r = client.post("/apply", json={"documents": [{"kind": "model", "name": "x"}] * 1001})
    assert r.status_code == 422 and r.json()["error"]["field"] == "documents"
    r = client.post("/apply", json={"documents": [], "dryrun": True})
    assert r.status_code == 422 and r.json()["error"]["field"] == "dryrun"
