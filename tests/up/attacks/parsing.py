"""Attack list cases (see tests/up/attacks/__init__.py): the gateway's request parsing, findings
5, 6, 11 and 15 of hardening-3. Fields the gateway acts on are read as the engine reads them
(``llmgw.gateway.engine_fields``); what an engine 500s on is refused first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.support.waiting import wait_for

USER = {"role": "user", "content": "hello"}


def _limited_key(run: Any) -> httpx.Client:
    """A client with a key of its own that allows 300 tokens per minute, once the gateway
    knows the key."""
    created = run.expect(
        "key with a 300 tpm limit",
        run.admin.post("/admin/v1/keys", json={"name": "parsing-tpm-300", "tpm": 300}),
        201,
    ).json()
    client = httpx.Client(
        base_url=str(run.gateway.base_url),
        headers={"Authorization": f"Bearer {created['key']}"},
        timeout=30,
    )
    wait_for(
        lambda: client.get("/v1/models").status_code == 200,
        timeout_s=15,
        what="the gateway to know the new key",
    )
    return client


def _max_tokens_as_the_engine_reads_it(run: Any) -> None:
    """Finding 5: `"250"` reserved the default 16 while the engine generated 250, so a
    300-per-minute key got 1,016 tokens in a minute. Now the reservation is 250: the first
    request fits the minute, the second (250.0) does not."""
    client = _limited_key(run)
    try:
        body = {"model": "demo", "prompt": "hello", "max_tokens": "250"}
        r = run.expect("max_tokens '250'", client.post("/v1/completions", json=body), 200)
        # The engine generated more than the 16 the gateway used to reserve.
        assert 16 < r.json()["usage"]["completion_tokens"] <= 250, r.text
        r = client.post("/v1/completions", json={**body, "max_tokens": 250.0})
        assert "tokens per minute" in run.expect("max_tokens 250.0 past the limit", r, 429).text
    finally:
        client.close()
    for value in ("25o", 250.5, -1):
        r = run.gateway.post(
            "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": value}
        )
        assert run.expect(f"max_tokens {value!r}", r, 400).json()["error"]["param"] == "max_tokens"


def _booleans_as_the_engine_reads_them(run: Any) -> None:
    """Finding 6: "no" was true to the gateway (its local render added a generation prompt)
    and false to the engine. Now both read it as false: the engine's prompt is the one of
    `false`."""

    def prompt_tokens(value: object) -> int:
        body = {
            "model": "demo",
            "messages": [USER],
            "max_tokens": 1,
            "add_generation_prompt": value,
        }
        r = run.gateway.post("/v1/chat/completions", json=body)
        return int(
            run.expect(f"add_generation_prompt {value!r}", r, 200).json()["usage"]["prompt_tokens"]
        )

    assert prompt_tokens("no") == prompt_tokens(False) != prompt_tokens(True)
    assert prompt_tokens("yes") == prompt_tokens(True)
    r = run.gateway.post(
        "/v1/chat/completions",
        json={"model": "demo", "messages": [USER], "add_generation_prompt": "maybe"},
    )
    assert "true or false" in run.expect("add_generation_prompt 'maybe'", r, 400).text


def _token_ids_out_of_range(run: Any) -> None:
    """Finding 11: an id of 2**63 overflowed the router's packing: a 500 and a traceback."""
    for ids in ([1, 2**63], [2**64 + 1], [-1], [5, 2**31]):
        r = run.gateway.post("/v1/completions", json={"model": "demo", "prompt": ids})
        error = run.expect(f"token ids {ids}", r, 400).json()["error"]
        assert error["param"] == "prompt" and "0..2147483647" in error["message"]


def _roles_the_engine_cannot_render(run: Any) -> None:
    """Finding 15: a role that is not a string made the engine's chat template raise (its
    500, relayed as a 502 telling the client to retry). Refused first, naming the field; a
    role that is a string is the engine's to judge (vLLM takes Llama's "ipython"; the demo's
    template renders any)."""
    for role in (5, None, ["user"], ""):
        body = {
            "model": "demo",
            "messages": [USER, {"role": role, "content": "x"}],
            "max_tokens": 2,
        }
        r = run.gateway.post("/v1/chat/completions", json=body)
        assert run.expect(f"role {role!r}", r, 400).json()["error"]["param"] == "messages[1].role"
    r = run.gateway.post(
        "/v1/chat/completions",
        json={"model": "demo", "messages": [{"role": "user", "content": 5}], "max_tokens": 2},
    )
    run.expect("content 5", r, 400)
    r = run.gateway.post(
        "/v1/chat/completions",
        json={"model": "demo", "messages": [{"role": "bogus", "content": "x"}], "max_tokens": 2},
    )
    run.expect("role 'bogus', a string the template renders", r, 200)


ATTACKS: list[Callable[[Any], None]] = [
    _max_tokens_as_the_engine_reads_it,
    _booleans_as_the_engine_reads_them,
    _token_ids_out_of_range,
    _roles_the_engine_cannot_render,
]
