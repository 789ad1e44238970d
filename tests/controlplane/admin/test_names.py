"""Names, clashes and strict counts through a real control plane (hardening-3 findings 10,
14, 16): a node stored with a newline in its name stays manageable; registration refuses
such a name; an adapter and a model cannot share a name (409 both ways, at the routes and at
apply); counts and switches are not coerced from strings or booleans."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest

from tests.controlplane.admin.admin_testkit import ControlPlane, name, sql

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.fixture
def agent(cp: ControlPlane) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cp.url, timeout=10) as c:
        yield c


def test_a_node_stored_with_a_newline_stays_manageable(
    cp: ControlPlane, client: httpx.Client
) -> None:
    bad = f"evil\n{name('row')}"
    sql(cp.db_url, "INSERT INTO nodes (id, name) VALUES (gen_random_uuid(), %s)", (bad,))
    path = f"/nodes/{quote(bad, safe='')}"
    got = client.get(path)
    assert got.status_code == 200 and got.json()["name"] == bad, got.text
    for verb in ("approve", "cordon", "drain", "uncordon"):
        assert client.post(f"{path}/{verb}").status_code == 200, verb
    # The name without its tail is no alias of another node.
    assert client.get("/nodes/" + quote(bad.split("\n")[0] + "\n", safe="")).status_code == 404
    assert client.delete(path).status_code == 204
    assert client.get(path).status_code == 404


def test_registration_refuses_a_name_with_a_newline(
    client: httpx.Client, agent: httpx.Client
) -> None:
    token = client.post("/bootstrap-tokens", json={}).json()["token"]
    r = agent.post(
        "/agent/v1/register",
        json={
            "bootstrap_token": token, "node_name": "fake\nrow", "mgmt_addr": "127.0.0.1",
            "inventory": {"cpu_threads": 1, "source": "file"},
        },
    )  # fmt: skip
    assert r.status_code == 422, r.text
    assert "node_name" in r.text and "LLMGW_AGENT__NODE_NAME" in r.text


def _profile(pname: str, model: str, *adapters: str) -> dict[str, object]:
    return {
        "name": pname, "model": model, "engine": "sim", "gpu_class": "sim",
        "model_path": "/m", "adapters": [{"name": a, "path": f"/a/{a}"} for a in adapters],
    }  # fmt: skip


def test_adapters_and_models_share_one_namespace(client: httpx.Client) -> None:
    base, other, lora = name("base"), name("other"), name("lora")
    assert client.post("/models", json={"name": base}).status_code == 201
    assert client.post("/models", json={"name": other}).status_code == 201
    assert client.post("/profiles", json=_profile(name("p"), base, lora)).status_code == 201
    # An adapter named like a model.
    r = client.post("/profiles", json=_profile(name("p"), other, base))
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "conflict" and error["field"] == "adapters.0.name"
    assert f"adapter name {base!r} is taken by model {base!r}" in error["message"]
    # A model named like an adapter.
    r = client.post("/models", json={"name": lora})
    assert r.status_code == 409 and f"model name {lora!r} is taken by an adapter" in r.text
    # The same through apply: 409, nothing written.
    r = client.post("/apply", json={"documents": [{"kind": "model", "name": lora}]})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["problems"][0]["field"] == "name"
    assert client.get(f"/models/{lora}").status_code == 404


@pytest.mark.parametrize("bad", ["3", True, 3.0, "true"])
def test_counts_are_not_coerced(client: httpx.Client, bad: object) -> None:
    r = client.post(
        "/deployments",
        json={"name": name("d"), "model": "m", "profile": "p", "replicas": bad},
    )
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "replicas"


def test_switches_are_not_coerced(client: httpx.Client) -> None:
    r = client.post("/bootstrap-tokens", json={"require_approval": "no"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "require_approval", r.text
