"""Attack list cases (see tests/up/attacks/__init__.py): the API families beyond chat and
completions (api-surface): Responses, Anthropic Messages and count_tokens, embeddings, rerank and
score. Each answers a body past the cap, a 970-deep body and a lone surrogate with its 4xx before
any engine reads it; a revoked key sent as Anthropic's `x-api-key` is a 401 in Anthropic's
shape; a made-up or altered response id is a 404 that reaches no engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.support.waiting import wait_for

DEEP = b"[" * 970 + b"]" * 970
# Every create route of the new families, with a body each would serve.
BODIES: dict[str, dict[str, Any]] = {
    "/v1/responses": {"model": "demo", "input": "hello", "max_output_tokens": 4},
    "/v1/messages": {
        "model": "demo",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}],
    },
    "/v1/messages/count_tokens": {
        "model": "demo",
        "messages": [{"role": "user", "content": "hello"}],
    },
    "/v1/embeddings": {"model": "demo", "input": "hello"},
}
# Pooling routes the simulator does not serve: their bounds hold all the same (the listener
# refuses before any engine is asked).
BOUNDED_ONLY = ("/v1/rerank", "/v1/score")


def _shape(path: str, r: httpx.Response) -> None:
    """An answer's error in its family's shape: Anthropic's on the Messages routes."""
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"], body
    else:
        assert body["error"]["message"], body


def _bounds_on_every_new_route(run: Any) -> None:
    cap = 8 * 1024 * 1024  # gateway.max_body_bytes' default
    for path in [*BODIES, *BOUNDED_ONLY]:
        r = run.gateway.post(path, content=DEEP, headers={"Content-Type": "application/json"})
        _shape(path, run.expect(f"{path}: 970-deep body", r, 400))
        big = b'{"model":"demo","input":"' + b"x" * cap + b'"}'
        r = run.gateway.post(path, content=big, headers={"Content-Type": "application/json"})
        _shape(path, run.expect(f"{path}: a body past the cap", r, 413))
        surrogate = b'{"model":"demo","input":"\\ud800","messages":[{"role":"user","content":"\\ud800"}],"max_tokens":4}'
        r = run.gateway.post(path, content=surrogate, headers={"Content-Type": "application/json"})
        _shape(path, run.expect(f"{path}: a lone surrogate", r, 400))
    for path, body in BODIES.items():
        run.expect(f"{path}: an ordinary request", run.gateway.post(path, json=body), 200)


def _forged_response_ids(run: Any) -> None:
    made = run.expect(
        "a stored response",
        run.gateway.post("/v1/responses", json=BODIES["/v1/responses"]),
        200,
    ).json()["id"]
    run.expect("its own id", run.gateway.get(f"/v1/responses/{made}"), 200)
    # One character changed, made up, another family's prefix, an engine's own id: all 404,
    # none reaching an engine (the simulator would answer its own 404 in another wording).
    altered = made[:-2] + ("A" if made[-2] != "A" else "B") + made[-1]
    for forged in (altered, "resp_madeup", "resp_" + "A" * 600, "msg_123", made + "x"):
        for r in (
            run.gateway.get(f"/v1/responses/{forged}"),
            run.gateway.post(f"/v1/responses/{forged}/cancel"),
            run.gateway.post(
                "/v1/responses",
                json={**BODIES["/v1/responses"], "previous_response_id": forged},
            ),
        ):
            answer = run.expect(f"forged id {forged[:20]}", r, 404).json()["error"]
            assert answer["code"] == "response_not_found", answer


def _revoked_key_as_x_api_key(run: Any) -> None:
    created = run.expect(
        "a key to revoke",
        run.admin.post("/admin/v1/keys", json={"name": "api-routes-revoked"}),
        201,
    ).json()
    with httpx.Client(base_url=str(run.gateway.base_url), timeout=30) as client:
        headers = {"x-api-key": created["key"], "anthropic-version": "2023-06-01"}
        wait_for(
            lambda: (
                client.post(
                    "/v1/messages", json=BODIES["/v1/messages"], headers=headers
                ).status_code
                == 200
            ),
            timeout_s=15,
            what="the gateway to know the new key",
        )
        run.expect("revoke", run.admin.post("/admin/v1/keys/api-routes-revoked/revoke"), 200)

        def refused() -> httpx.Response | None:
            r = client.post("/v1/messages", json=BODIES["/v1/messages"], headers=headers)
            return r if r.status_code == 401 else None

        r = wait_for(refused, timeout_s=15, what="the revoked key refused")
        run.expect("revoked x-api-key", r, 401)
        assert r.json()["error"]["type"] == "authentication_error", r.text
        # x-api-key is Anthropic's header only: on the OpenAI routes it is no key at all.
        r = client.post("/v1/responses", json=BODIES["/v1/responses"], headers=headers)
        run.expect("x-api-key on /v1/responses", r, 401)


ATTACKS: list[Callable[[Any], None]] = [
    _bounds_on_every_new_route,
    _forged_response_ids,
    _revoked_key_as_x_api_key,
]
