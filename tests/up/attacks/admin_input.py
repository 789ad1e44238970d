"""Attack list cases (see tests/up/attacks/__init__.py): hostile names and values sent to
the admin and agent APIs.

- Finding 10: a node registered with a newline in its name was unreachable through
  /admin/v1/nodes/{name} and painted fake rows into `llmgw status`; registration now refuses
  any name outside the one name rule (llmgw.protocol.names) with 422 naming the setting.
- Finding 13 (duplicate YAML keys): the admin apply endpoint takes JSON, not YAML, so the
  YAML refusals are the CLI's (tests/documents/test_yaml_bombs.py), not a case here.
- Finding 14: an adapter named like a model (or the reverse) was stored and then silently
  dropped by the gateway; now 409 naming the clash, at the routes and at apply.
- Finding 16: a profile's env could set PATH (and HOME, OPENSSL_CONF, the compiled-code
  caches), secret_env could name the control plane's admin token, and counts were coerced
  from strings and booleans; each is now a 422 naming the field.

The demo (model `demo`, profile `demo-sim` with adapter `demo-sql`, deployment `demo`) is
left as it was: every case here is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx


def _error(r: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = r.json()["error"]
    return body


def _node_name_with_a_newline(run: Any) -> None:
    token = run.expect(
        "a bootstrap token", run.admin.post("/admin/v1/bootstrap-tokens", json={}), 201
    ).json()["token"]
    for hostile in ("fake\nrow  ok  1", "\x1b]0;evil\x07node", "node\n"):
        r = run.anonymous.post(
            "/agent/v1/register",
            json={
                "bootstrap_token": token, "node_name": hostile, "mgmt_addr": "127.0.0.1",
                "inventory": {"cpu_threads": 1, "source": "file"},
            },
        )  # fmt: skip
        run.expect(f"register node {hostile!r}", r, 422)
        assert "node_name" in r.text and "LLMGW_AGENT__NODE_NAME" in r.text, r.text
    # Nothing was registered under any of them: the listing holds no control character.
    nodes = run.expect("nodes", run.admin.get("/admin/v1/nodes"), 200).json()["items"]
    assert all(n["name"].isprintable() for n in nodes), nodes


def _adapter_and_model_names_clash(run: Any) -> None:
    r = run.expect(
        "a model named like the demo's adapter",
        run.admin.post("/admin/v1/models", json={"name": "demo-sql"}),
        409,
    )
    assert "model name 'demo-sql' is taken by an adapter of profile 'demo-sim'" in r.text
    profile = {
        "name": "clash-sim", "model": "demo", "engine": "sim", "gpu_class": "sim",
        "model_path": "/models/demo", "adapters": [{"name": "demo", "path": "/a"}],
    }  # fmt: skip
    r = run.expect(
        "an adapter named like the demo model",
        run.admin.post("/admin/v1/profiles", json=profile),
        409,
    )
    assert _error(r)["field"] == "adapters.0.name" and "taken by model 'demo'" in r.text
    r = run.expect(
        "apply: a model named like the demo's adapter",
        run.admin.post(
            "/admin/v1/apply", json={"documents": [{"kind": "model", "name": "demo-sql"}]}
        ),
        409,
    )
    run.expect("no such model", run.admin.get("/admin/v1/models/demo-sql"), 404)


def _profile_env_and_secret_refs(run: Any) -> None:
    base = {
        "name": "env-sim", "model": "demo", "engine": "sim", "gpu_class": "sim",
        "model_path": "/models/demo",
    }  # fmt: skip
    for field, values in (
        ("env", {"PATH": "/tmp/evil"}),
        ("env", {"HOME": "/tmp/evil"}),
        ("env", {"OPENSSL_CONF": "/tmp/evil.cnf"}),
        ("env", {"TRITON_CACHE_DIR": "/tmp/evil"}),
        ("secret_env", {"HF_TOKEN": "env:LLMGW_CONTROLPLANE__ADMIN_TOKEN"}),
        ("secret_env", {"HF_TOKEN": "file:/proc/self/environ"}),
    ):
        r = run.expect(
            f"profile {field} {values}",
            run.admin.post("/admin/v1/profiles", json={**base, field: values}),
            422,
        )
        (variable,) = values
        assert variable in _error(r)["message"], r.text
    run.expect("no such profile", run.admin.get("/admin/v1/profiles/env-sim"), 404)


def _counts_not_coerced(run: Any) -> None:
    for bad in ("3", True, 3.0):
        r = run.expect(
            f"scale demo to {bad!r}",
            run.admin.post("/admin/v1/deployments/demo/scale", json={"replicas": bad}),
            422,
        )
        assert _error(r)["field"] == "replicas", r.text
    r = run.expect(
        "a token with require_approval 'no'",
        run.admin.post("/admin/v1/bootstrap-tokens", json={"require_approval": "no"}),
        422,
    )
    assert _error(r)["field"] == "require_approval", r.text


ATTACKS: list[Callable[[Any], None]] = [
    _node_name_with_a_newline,
    _adapter_and_model_names_clash,
    _profile_env_and_secret_refs,
    _counts_not_coerced,
]
