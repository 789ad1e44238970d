"""Hostile bodies sent to a real `llmgw simengine`: lone surrogates and text that is not UTF-8
(a plain-text 500 before), and values quoted back in errors (a 1 MB model name came back
whole): each is a 400/404 in OpenAI's shape, small, and the engine serves on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.simengine.sim_process import SimProcess

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sim(sim_factory: Callable[..., SimProcess]) -> SimProcess:
    return sim_factory("--served-model-name", "sim")


def _post(sim: SimProcess, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        f"{sim.base_url}{path}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


# As a client writes them: JSON text with the escape (json.dumps would write "\ud800" too).
SURROGATES = {
    "prompt": ("/v1/completions", rb'{"prompt": "hi \ud800", "max_tokens": 2}'),
    "prompt, streamed": (
        "/v1/completions",
        rb'{"prompt": "\udfff", "max_tokens": 2, "stream": true}',
    ),
    "prompt list": ("/v1/completions", rb'{"prompt": ["\uD800"], "max_tokens": 2}'),
    "content": (
        "/v1/chat/completions",
        rb'{"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}',
    ),
    "role": (
        "/v1/chat/completions",
        rb'{"messages": [{"role": "\ud800", "content": "hi"}], "max_tokens": 2}',
    ),
    "stop": ("/v1/completions", rb'{"prompt": "hi", "stop": ["\udc00"], "max_tokens": 2}'),
    "a key": ("/v1/completions", rb'{"prompt": "hi", "\ud800": 1, "max_tokens": 2}'),
    "tokenize": ("/tokenize", rb'{"prompt": "\ud800"}'),
    "tokenize chat": ("/tokenize", rb'{"messages": [{"role": "user", "content": "\ud800"}]}'),
}


@pytest.mark.parametrize("case", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_it(sim: SimProcess, case: str) -> None:
    path, body = SURROGATES[case]
    error = _error(_post(sim, path, body), 400)
    assert error["type"] == "invalid_request_error"
    assert "lone UTF-16 surrogate" in error["message"] and "send UTF-8" in error["message"]


def test_an_encoded_surrogate_is_not_utf8(sim: SimProcess) -> None:
    body = b'{"prompt": "hi \xed\xa0\x80", "max_tokens": 2}'
    assert "not UTF-8" in _error(_post(sim, "/v1/completions", body), 400)["message"]


def test_text_that_only_looks_like_a_surrogate_is_served(sim: SimProcess) -> None:
    # A pair (an emoji from an ASCII-only client) and an escaped backslash before "ud800".
    for prompt in (rb"\ud83d\ude00 hi", rb"\\ud800"):
        body = b'{"prompt": "' + prompt + b'", "max_tokens": 2}'
        response = _post(sim, "/v1/completions", body)
        assert response.status_code == 200, response.text
    assert _post(sim, "/tokenize", rb'{"prompt": "\ud83d\ude00"}').json()["count"] > 0


def test_an_unknown_models_name_is_quoted_cut_short(sim: SimProcess) -> None:
    name = "m" * 1_000_000
    body = b'{"model": "' + name.encode() + b'", "prompt": "hi"}'
    response = _post(sim, "/v1/completions", body)
    error = _error(response, 404)
    assert error["param"] == "model" and "…" in error["message"]
    assert len(response.content) < 1000
    assert len(_post(sim, "/tokenize", body).content) < 1000


def test_many_wrong_items_name_a_few(sim: SimProcess) -> None:
    body = b'{"prompt": [' + b",".join([b"null"] * 20_000) + b"]}"
    response = _post(sim, "/v1/completions", body)
    error = _error(response, 400)
    assert error["param"] == "prompt" and "more)" in error["message"]
    assert len(response.content) < 2000
    ok = _post(sim, "/v1/completions", b'{"prompt": "still here", "max_tokens": 2}')
    assert ok.status_code == 200, ok.text
