"""POST /admin/v1/apply against a real control plane: all or nothing, every problem listed,
created / configured / unchanged, dry runs that write nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.controlplane.admin.admin_testkit import ControlPlane, count, name, sql

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

_TABLES = ("models", "profiles", "deployments", "audit_log")


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


def _results(client: httpx.Client, docs: list[dict[str, Any]], dry_run: bool) -> Any:
    r = client.post("/apply", json={"documents": docs, "dry_run": dry_run})
    assert r.status_code == 200, r.text
    return r


def _profile_doc(model: str, profile: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "profile", "name": profile, "model": model, "engine": "sim",
            "model_path": "/models/demo", **extra}  # fmt: skip


def _deployment_doc(model: str, profile: str, dep: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "deployment", "name": dep, "model": model, "profile": profile, **extra}


def test_a_configured_object_lists_its_changes_and_the_replicas_it_rolls(
    client: httpx.Client, cp: ControlPlane
) -> None:
    model, p1, p2, moving, staying = name("m"), name("p"), name("p"), name("d"), name("d")
    ref, new_ref = f"file:/run/secrets/{name('hf')}", f"file:/run/secrets/{name('hf')}"
    stored = [
        {"kind": "model", "name": model, "description": "before"},
        _profile_doc(model, p1, args=["--max-num-seqs", "8"], env={"OLD": "1"},
                     secret_env={"HF_TOKEN": ref, "GONE": ref}),
        _profile_doc(model, p2, args=["--max-num-seqs", "4"]),
        _deployment_doc(model, p1, moving, replicas=4),
        _deployment_doc(model, p1, staying, replicas=3),
    ]  # fmt: skip
    _apply(client, stored)
    before = client.get(f"/profiles/{p1}").json()
    rows = _rows(cp)
    docs = [
        {"kind": "model", "name": model, "description": "after"},
        _profile_doc(model, p1, args=["--max-num-seqs", "16"], env={"NEW": "2"},
                     secret_env={"HF_TOKEN": new_ref, "WANDB_API_KEY": ref}),
        _deployment_doc(model, p2, moving, replicas=2),
    ]  # fmt: skip
    r = _results(client, docs, dry_run=True)
    assert ref not in r.text and new_ref not in r.text  # references are write-only
    m, p, d = r.json()["results"]
    assert [x["result"] for x in (m, p, d)] == ["configured"] * 3
    assert m["changes"] == [
        {"field": "description", "change": "changed", "old": "before", "new": "after",
         "secret": False},
    ]  # fmt: skip
    assert (m["rolls"], m["rolled_deployments"]) == (0, [])
    changes = {c["field"]: c for c in p["changes"]}
    assert changes["args"]["old"] == ["--max-num-seqs", "8"]
    assert changes["args"]["new"] == ["--max-num-seqs", "16"]
    assert (changes["env.OLD"]["change"], changes["env.OLD"]["old"]) == ("removed", "1")
    assert (changes["env.NEW"]["change"], changes["env.NEW"]["new"]) == ("added", "2")
    assert {(c["field"], c["change"], c["old"], c["new"]) for c in p["changes"] if c["secret"]} == {
        ("secret_env.HF_TOKEN", "changed", None, None),
        ("secret_env.WANDB_API_KEY", "added", None, None),
        ("secret_env.GONE", "removed", None, None),
    }
    assert changes["fingerprint"]["old"] == before["fingerprint"]
    assert set(changes) == {
        "args", "env.OLD", "env.NEW", "secret_env.HF_TOKEN", "secret_env.WANDB_API_KEY",
        "secret_env.GONE", "fingerprint",
    }  # fmt: skip
    # The deployment that moves to p2 rolls by its own document, once; the one that stays
    # on p1 by the profile's.
    assert (p["rolls"], p["rolled_deployments"]) == (3, [staying])
    assert [(c["field"], c["old"], c["new"]) for c in d["changes"]] == [
        ("profile", p1, p2),
        ("replicas", 4, 2),
    ]
    assert (d["rolls"], d["rolled_deployments"]) == (2, [moving])
    assert _rows(cp) == rows

    # The same documents applied: the same report, and now it is true.
    applied = _results(client, docs, dry_run=False).json()["results"]
    assert applied == r.json()["results"]
    assert _results(client, docs, dry_run=True).json()["results"] == [
        {**x, "result": "unchanged", "changes": [], "rolls": 0, "rolled_deployments": []}
        for x in applied
    ]


def test_a_change_that_keeps_the_fingerprint_rolls_nothing(client: httpx.Client) -> None:
    model, profile, dep, twin = name("m"), name("p"), name("d"), name("p")
    _apply(client, [
        {"kind": "model", "name": model},
        _profile_doc(model, profile), _profile_doc(model, twin),
        _deployment_doc(model, profile, dep, replicas=2),
    ])  # fmt: skip
    docs = [
        _profile_doc(model, profile, description="only words"),
        # Another profile with the same launch fields: the same fingerprint, nothing restarts.
        _deployment_doc(model, twin, dep, replicas=5, state="active"),
    ]
    p, d = _results(client, docs, dry_run=True).json()["results"]
    assert [c["field"] for c in p["changes"]] == ["description"] and p["rolls"] == 0
    assert [c["field"] for c in d["changes"]] == ["profile", "replicas"] and d["rolls"] == 0
    suspended = [_deployment_doc(model, profile, dep, replicas=2, state="suspended"),
                 _profile_doc(model, profile, args=["--max-num-seqs", "2"])]  # fmt: skip
    d, p = _results(client, suspended, dry_run=True).json()["results"]
    assert [(c["field"], c["old"], c["new"]) for c in d["changes"]] == [
        ("state", "active", "suspended")
    ]
    # A suspended deployment keeps its replicas as they are until it resumes.
    assert (p["result"], p["rolls"]) == ("configured", 0)


def test_references_of_schema_invalid_documents_are_checked_in_the_same_pass(
    client: httpx.Client, cp: ControlPlane
) -> None:
    model, typo_profile, bad_profile = name("m"), name("p"), name("p")
    rows = _rows(cp)
    docs = [
        {"kind": "model", "name": model},
        # A typo, and a model that exists nowhere.
        {"kind": "profile", "name": bad_profile, "model": "missing-model", "engine": "sim",
         "model_pth": "/m"},
        # A typo, and a profile that exists nowhere.
        {"kind": "deployment", "name": name("d"), "model": model, "profile": "missing-profile",
         "replica": 3},
        # A profile defined in this file counts as present, even one with a problem of its own.
        {"kind": "deployment", "name": name("d"), "model": model, "profile": typo_profile},
        {"kind": "profile", "name": typo_profile, "model": model, "engine": "sim",
         "model_path": "/m", "tp": "two"},
        # ... but it must be a profile of the deployment's model.
        {"kind": "deployment", "name": name("d"), "model": model, "profile": bad_profile},
        {"kind": "profile", "name": name("p"), "model": model, "engine": "sim",
         "model_path": "/m", "adapters": [{"name": "a", "pth": "/a"}]},
        {"kind": "deploymnet", "name": name("d")},
    ]  # fmt: skip
    r = client.post("/apply", json={"documents": docs})
    assert r.status_code == 422, r.text
    problems = r.json()["error"]["problems"]
    assert [(p["index"], p["field"]) for p in problems] == [
        (1, "model_path"), (1, "model_pth"), (1, "model"),
        (2, "replica"), (2, "profile"),
        (4, "tp"),
        (5, "profile"),
        (6, "adapters.0.path"), (6, "adapters.0.pth"),
        (7, "kind"),
    ], problems  # fmt: skip
    message = {(p["index"], p["field"]): p["message"] for p in problems}
    assert message[1, "model_pth"] == "unknown field `model_pth`; did you mean `model_path`?"
    assert message[2, "replica"] == "unknown field `replica`; did you mean `replicas`?"
    assert message[6, "adapters.0.pth"] == (
        "unknown field `adapters.0.pth`; did you mean `adapters.0.path`?"
    )
    assert "did you mean `deployment`?" in message[7, "kind"]
    assert "missing-model" in message[1, "model"] and "kind: model" in message[1, "model"]
    assert "missing-profile" in message[2, "profile"]
    assert "missing-model" in message[5, "profile"] and model in message[5, "profile"]
    assert _rows(cp) == rows


def test_an_unknown_field_with_no_near_name_lists_the_fields(client: httpx.Client) -> None:
    r = client.post("/apply", json={"documents": [{"kind": "model", "name": "x", "colour": 1}]})
    [problem] = r.json()["error"]["problems"]
    assert problem["message"] == "unknown field `colour`; the fields here are: name, description"


def test_max_in_flight_is_configured_without_a_roll(client: httpx.Client, cp: ControlPlane) -> None:
    """A profile's admission ceiling changes what the gateways send, not the process: the
    fingerprint and the deployment's generation stay; the profile's version moves."""
    model, profile, dep = name("m"), name("p"), name("d")
    _apply(client, _docs(model, profile, dep))
    stored = client.get(f"/profiles/{profile}").json()
    assert stored["max_in_flight"] == 0  # the engine's default
    assert _apply(client, _docs(model, profile, dep, max_in_flight=40))[2] == (
        2, "profile", "configured",
    )  # fmt: skip
    p = client.get(f"/profiles/{profile}").json()
    assert (p["max_in_flight"], p["fingerprint"]) == (40, stored["fingerprint"])
    assert client.get(f"/deployments/{dep}").json()["generation"] == 1
    r = client.patch(f"/profiles/{profile}", json={"version": p["version"], "max_in_flight": 0})
    assert r.status_code == 200 and r.json()["fingerprint"] == stored["fingerprint"], r.text


def test_an_autoscale_policy_applies_is_shown_and_is_validated(
    client: httpx.Client, cp: ControlPlane
) -> None:
    model, profile, dep = name("m"), name("p"), name("d")
    policy = {"min_replicas": 0, "max_replicas": 4, "target_queued_prefill_tokens": 8000,
              "suspend_after_s": 60, "zero_after_s": 600}  # fmt: skip
    docs = _docs(model, profile, dep)
    docs[0]["autoscale"] = policy
    assert _apply(client, docs)[0] == (0, "deployment", "created")
    got = client.get(f"/deployments/{dep}").json()
    assert got["autoscale"] == {**policy, "target_waiting_requests": None,
                                "scale_up_window_s": 30.0, "scale_down_window_s": 300.0}  # fmt: skip
    assert got["autoscale_status"] is None  # no decision yet
    assert got["status"]["suspended_replicas"] == 0
    assert _apply(client, docs)[0] == (0, "deployment", "unchanged")
    # PATCH removes it in words of its own (an absent field leaves it as it is), and the
    # leader's last decision with it.
    sql(
        cp.db_url,
        "INSERT INTO deployment_autoscale (deployment_id, desired_replicas, warm_replicas) "
        "SELECT id, 3, 3 FROM deployments WHERE name = %s ON CONFLICT DO NOTHING",
        (dep,),
    )
    r = client.patch(
        f"/deployments/{dep}", json={"version": got["version"], "remove_autoscale": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["autoscale"] is None
    where = "deployment_id = (SELECT id FROM deployments WHERE name = %s)"
    assert count(cp.db_url, "deployment_autoscale", where, (dep,)) == 0
    bad = [
        ({"min_replicas": 3, "max_replicas": 2, "target_waiting_requests": 1},
         "max_replicas 2 is below min_replicas 3"),
        ({"min_replicas": 0, "max_replicas": 2}, "give target_queued_prefill_tokens"),
        ({"min_replicas": 0, "max_replicas": 2, "target_waiting_requests": 1,
          "suspend_after_s": 600, "zero_after_s": 60}, "give zero_after_s >= suspend_after_s"),
        ({"min_replicas": 0, "max_replicas": 2, "target_waiting_requests": 1,
          "scale_up_window_s": 7200}, "3600"),
        ({"min_replicas": 0, "max_replicas": 2, "target_waiting_requests": 1, "cooldown": 5},
         "cooldown"),
    ]  # fmt: skip
    for body, words in bad:
        d = _docs(model, profile, dep)
        d[0]["autoscale"] = body
        r = client.post("/apply", json={"documents": d})
        assert r.status_code == 422, r.text
        text = json.dumps(r.json()["error"]["problems"])
        assert words in text, text
