"""Hostile bodies sent to the gateway served for real (against a real simulator): JSON nested
past the bound, NaN, lone surrogates and text that is not UTF-8 (each a 500 with a traceback
before), and names quoted back in errors (a 4 MB model name came back whole). Each is a 400 or
404 in OpenAI's shape, refused before admission, and the gateway serves on.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.gateway_testkit import Key, Served, endpoint, serve_gateway, table
from tests.simengine.sim_process import SimProcess, start_sim, stop_sim

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

GOOD = Key("k1", "good")
AUTH = {"Authorization": "Bearer llmgw_k1_s1", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    sim: SimProcess = start_sim(
        tmp_path_factory.mktemp("sim"),
        "--served-model-name",
        "m",
        env={"SIMENGINE_API_KEY": "sim-engine-key"},
    )
    try:
        with serve_gateway(table({"m": (endpoint("r0", sim.base_url),)}), {"s1": GOOD}) as served:
            yield served
    finally:
        stop_sim(sim)


def _post(gw: Served, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", content=body, headers=AUTH, timeout=10)


def _error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


def _refused_before_admission(gw: Served, path: str, body: bytes) -> dict[str, object]:
    admitted = len(gw.limits.admissions)
    err = _error(_post(gw, path, body), 400)
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_json")
    assert len(gw.limits.admissions) == admitted
    return err


def _served(gw: Served, path: str, body: bytes) -> None:
    r = _post(gw, path, body)
    assert r.status_code == 200, r.text[:500]


ROUTES = ("/v1/chat/completions", "/v1/completions")


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("depth", [970, 100_000])
def test_deep_nesting_is_a_400(gw: Served, path: str, depth: int) -> None:
    # The body: ~2 KB at 970 levels.
    body = b'{"x": ' + b"[" * depth + b"]" * depth + b"}"
    err = _refused_before_admission(gw, path, body)
    assert "more than 64 levels" in str(err["message"])


def test_nesting_within_the_bound_is_served(gw: Served) -> None:
    # The body's object and 63 lists: 64 levels.
    extra = b"[" * 63 + b"]" * 63
    _served(gw, "/v1/completions", b'{"model":"m","prompt":"hi","max_tokens":2,"x":' + extra + b"}")


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_refused_by_the_gateway(gw: Served, constant: bytes) -> None:
    body = b'{"model":"m","prompt":"hi","max_tokens":2,"temperature":' + constant + b"}"
    err = _refused_before_admission(gw, "/v1/completions", body)
    assert "send a finite number" in str(err["message"])


_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
# As a client writes them: JSON text with the escape.
SURROGATES = {
    "prompt": (_COMPLETIONS, rb'{"model":"demo","prompt":"\ud800"}'),
    "prompt of a known model": (_COMPLETIONS, rb'{"model":"m","prompt":"hi \ud800"}'),
    "prompt, streamed": (_COMPLETIONS, rb'{"model":"m","prompt":"\ud800","stream":true}'),
    "prompt list": (_COMPLETIONS, rb'{"model":"m","prompt":["ok","\ud800"]}'),
    "upper case": (_COMPLETIONS, rb'{"model":"m","prompt":"\uD800"}'),
    "low half": (_COMPLETIONS, rb'{"model":"m","prompt":"\udfff"}'),
    "stop": (_COMPLETIONS, rb'{"model":"m","prompt":"hi","stop":["\ud800"]}'),
    "user": (_COMPLETIONS, rb'{"model":"m","prompt":"hi","user":"\ud800"}'),
    "a key": (_COMPLETIONS, rb'{"model":"m","prompt":"hi","\ud800":1}'),
    "content": (_CHAT, rb'{"model":"m","messages":[{"role":"user","content":"\ud800"}]}'),
    "content, streamed": (
        _CHAT,
        rb'{"model":"m","stream":true,"messages":[{"role":"user","content":"\ud800"}]}',
    ),
    "content part": (
        _CHAT,
        rb'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"\ud800"}]}]}',
    ),
    "role": (_CHAT, rb'{"model":"m","messages":[{"role":"\ud800","content":"hi"}]}'),
    "model": (_CHAT, rb'{"model":"\ud800","messages":[{"role":"user","content":"hi"}]}'),
}


@pytest.mark.parametrize("case", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_it(gw: Served, case: str) -> None:
    path, body = SURROGATES[case]
    message = str(_refused_before_admission(gw, path, body)["message"])
    assert "lone UTF-16 surrogate (\\u" in message and "send UTF-8 text" in message


def test_an_encoded_surrogate_is_not_utf8(gw: Served) -> None:
    err = _refused_before_admission(gw, _COMPLETIONS, b'{"model":"m","prompt":"\xed\xa0\x80"}')
    assert "not UTF-8" in str(err["message"])


def test_text_that_only_looks_like_a_surrogate_is_served(gw: Served) -> None:
    # A pair (an emoji from an ASCII-only client), an escaped backslash before "ud800", and a
    # pair in chat content: all text the engine can take.
    for prompt in (rb"\ud83d\ude00 hi", rb"\\ud800"):
        _served(gw, _COMPLETIONS, b'{"model":"m","max_tokens":2,"prompt":"' + prompt + b'"}')
    _served(
        gw,
        _CHAT,
        rb'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"\ud83d\ude00"}]}',
    )


def test_names_are_quoted_cut_short(gw: Served) -> None:
    name = b"m" * (4 << 20)
    r = _post(gw, _COMPLETIONS, b'{"model":"' + name + b'","prompt":"hi"}')
    err = _error(r, 404)
    assert err["code"] == "model_not_found" and "…" in str(err["message"])
    assert len(r.content) < 1000
    r = httpx.get(f"{gw.url}/v1/{'x' * 8000}", headers=AUTH, timeout=10)
    assert _error(r, 404)["code"] == "unknown_url" and len(r.content) < 1000


def test_the_gateway_serves_on(gw: Served) -> None:
    _served(gw, _COMPLETIONS, b'{"model":"m","prompt":"still here","max_tokens":2}')
