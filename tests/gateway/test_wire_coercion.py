"""The fields the gateway acts on, read as the engines read them (hardening findings 5, 6, 11
and 15): ``max_tokens: "250"`` reserves 250 and reaches the engine as 250; ``"no"`` is False to
the local tokenizer as to the engine; token ids past 2**31 and roles that are not strings are
400s; an engine's own 500 is a 502 that does not tell the client to retry."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from llmgw.config import GatewaySettings
from llmgw.gateway.engine_fields import canonicalize
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.routing.router import token_home_key
from llmgw.gateway.tokens import CHARS_PER_TOKEN
from llmgw.gateway.upstream import engine_said
from llmgw.gateway.wire import MAX_TOKEN_ID, prompt_of, reserve_tokens
from tests.gateway.gateway_testkit import Key, endpoint, serve_asgi, serve_gateway, table

SETTINGS = GatewaySettings(default_max_tokens=1000)


def _canonical(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    canonicalize(body, chat=chat)
    return body


def _refused(body: dict[str, Any], *, chat: bool) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        canonicalize(body, chat=chat)
    assert err.value.status == 400
    return err.value


# --- finding 5: counts read as pydantic's lax mode reads them ----------------------------


@pytest.mark.parametrize("value", [250, 250.0, "250", " 250 ", "250.0", "2_50"])
@pytest.mark.parametrize("chat", [False, True])
def test_max_tokens_is_the_engines_int_and_reserved_so(value: object, chat: bool) -> None:
    body = _canonical({"max_tokens": value}, chat=chat)
    assert body["max_tokens"] == 250 and type(body["max_tokens"]) is int
    assert reserve_tokens(body, chat, SETTINGS) == 250


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens", "n", "best_of"])
@pytest.mark.parametrize("value", [250.5, "25a", "1e3", "", [250], {"v": 1}, float("inf")])
def test_counts_no_engine_reads_are_refused_naming_the_field(name: str, value: object) -> None:
    err = _refused({name: value}, chat=False)
    assert err.param == name and f"`{name}` must be a whole number" in err.message


def test_a_refusal_does_not_echo_the_value() -> None:
    err = _refused({"max_tokens": "sk-secret-pasted-here"}, chat=True)
    assert "sk-secret" not in err.message and "got a string" in err.message


@pytest.mark.parametrize(
    ("name", "value", "least"), [("max_tokens", -1, 0), ("n", 0, 1), ("best_of", "0", 1)]
)
def test_counts_below_what_any_engine_takes_are_refused(
    name: str, value: object, least: int
) -> None:
    err = _refused({name: value}, chat=False)
    assert f"at least {least}" in err.message and err.param == name


def test_n_and_best_of_multiply_the_reservation_as_the_engine_generates() -> None:
    assert (
        reserve_tokens(_canonical({"max_tokens": "10", "n": "3"}, chat=False), False, SETTINGS)
        == 30
    )
    body = _canonical({"max_tokens": 10, "n": 2, "best_of": 5.0}, chat=False)
    assert reserve_tokens(body, False, SETTINGS) == 50


def test_reservation_reads_max_tokens_as_vllm_get_max_tokens_does() -> None:
    # `max_completion_tokens or max_tokens`, on completions too (vLLM reads the extra field).
    assert reserve_tokens({"max_completion_tokens": 300}, False, SETTINGS) == 300
    assert reserve_tokens({"max_completion_tokens": 0, "max_tokens": 40}, True, SETTINGS) == 40
    # A completion that sends no max_tokens gets 16; one that sends null gets no limit (vLLM
    # generates to the context's end): before, both reserved 16.
    assert reserve_tokens({}, False, SETTINGS) == 16
    assert reserve_tokens({"max_tokens": None}, False, SETTINGS) == 1000
    limit = reserve_tokens(
        {"max_tokens": None}, False, SETTINGS, context_limit=4096, prompt_tokens=96
    )
    assert limit == 4000


def test_nullable_fields_take_null_and_others_refuse_it() -> None:
    assert _canonical({"n": None, "max_tokens": None}, chat=True) == {"n": None, "max_tokens": None}
    assert _refused({"n": None}, chat=False).param == "n"  # vLLM: completions' n is `int`
    assert _refused({"add_generation_prompt": None}, chat=True).param == "add_generation_prompt"


# --- finding 6: booleans as pydantic reads them -------------------------------------------

FALSE = [False, "no", "No", "false", "FALSE", "0", "off", "f", "n", 0, 0.0]
TRUE = [True, "yes", "true", "True", "1", "on", "t", "y", 1, 1.0]


@pytest.mark.parametrize(
    "name",
    ["add_generation_prompt", "continue_final_message", "add_special_tokens", "echo", "stream"],
)
def test_booleans_are_the_engines_bool(name: str) -> None:
    for value in FALSE:
        assert _canonical({name: value}, chat=True)[name] is False, value
    for value in TRUE:
        assert _canonical({name: value}, chat=True)[name] is True, value
    for value in ["maybe", " yes", "", 2, 0.5, [], {}]:
        err = _refused({name: value}, chat=True)
        assert err.param == name and "true or false" in err.message


def test_add_generation_prompt_no_renders_as_the_engine_renders() -> None:
    # The local renderer (llmgw.kv.hf_tokenizer) reads bool(body[...]): "no" was True there.
    body = _canonical({"add_generation_prompt": "no", "continue_final_message": "yes"}, chat=True)
    assert body == {"add_generation_prompt": False, "continue_final_message": True}


def test_stream_options_are_read_as_the_engine_reads_them() -> None:
    body = _canonical({"stream": "true", "stream_options": {"include_usage": "no"}}, chat=True)
    assert body == {"stream": True, "stream_options": {"include_usage": False}}
    assert _refused({"stream_options": "yes"}, chat=True).param == "stream_options"
    assert _refused({"stream_options": {"include_usage": "x"}}, chat=False).param == (
        "stream_options.include_usage"
    )


def test_fields_the_gateway_does_not_read_are_left_to_the_engine() -> None:
    body = {"temperature": "hot", "logprobs": "x", "seed": 2**70, "max_tokens": 5}
    assert _canonical(dict(body), chat=False) == body


# --- finding 11: token ids ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [2**63, 2**64 + 5, -1, MAX_TOKEN_ID + 1])
def test_token_ids_outside_the_range_are_400_naming_it(bad: int) -> None:
    with pytest.raises(GatewayError) as err:
        prompt_of({"prompt": [1, 2, bad]}, chat=False)
    assert err.value.status == 400 and err.value.param == "prompt"
    assert f"0..{MAX_TOKEN_ID}" in err.value.message and "prompt[2]" in err.value.message
    assert prompt_of({"prompt": [0, MAX_TOKEN_ID]}, chat=False).token_ids == [0, MAX_TOKEN_ID]


def test_token_home_key_survives_an_id_past_64_bits() -> None:
    # Only a replica's /tokenize could hand one over now; it was an OverflowError (a 500).
    assert token_home_key([2**64] * 64, 16, [0.0, 0.0]) is None


# --- finding 15: what an engine 500s on, refused first; what it still 500s, named -----------


@pytest.mark.parametrize("role", [5, None, ["user"], {"r": 1}, ""])
def test_a_role_that_is_not_a_string_is_400(role: object) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]}
    with pytest.raises(GatewayError) as err:
        prompt_of(body, chat=True)
    assert err.value.status == 400 and err.value.param == "messages[1].role"


def test_any_string_role_passes_to_the_engine() -> None:
    # vLLM takes roles beyond OpenAI's (Llama 3's "ipython"); its template judges them.
    for role in ("ipython", "bogus", "developer"):
        assert role in prompt_of({"messages": [{"role": role, "content": "x"}]}, chat=True).text


@pytest.mark.parametrize("content", [5, 1.5, True, {"text": "x"}])
def test_content_of_no_engine_shape_is_400(content: object) -> None:
    with pytest.raises(GatewayError) as err:
        prompt_of({"messages": [{"role": "user", "content": content}]}, chat=True)
    assert err.value.param == "messages[0].content"


def test_engine_said_tells_the_engines_answer_from_a_failure_on_the_way() -> None:
    def proxy(code: str) -> bytes:
        return json.dumps(
            {"error": {"message": "m", "type": "server_error", "code": code}}
        ).encode()

    assert engine_said(502, proxy("upstream-failed")) is None
    assert engine_said(504, proxy("upstream-timeout")) is None
    assert engine_said(502, b"Bad Gateway") is None
    assert engine_said(503, b"{}") is None
    assert engine_said(500, b"Internal Server Error") == "Internal Server Error"
    assert engine_said(500, b'{"error":{"message":"bad\\n role","code":500}}') == "bad role"
    assert engine_said(500, b'{"object":"error","message":"old shape","code":500}') == "old shape"
    assert engine_said(500, b"") == ""


async def _engine_500(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 500,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": b"Internal Server Error"})


async def _echo_engine(scope: Any, receive: Any, send: Any) -> None:
    """An engine that answers a completion with the body it was sent (its other routes, the
    gateway's scrapes, 404)."""
    if scope["type"] != "http":
        return
    if scope["path"] != "/v1/completions":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = json.dumps({"received": json.loads(raw)}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": answer})


GOOD = Key("k1", "good")
AUTH = {"Authorization": "Bearer llmgw_k1_s1"}


def test_an_engines_own_500_is_a_502_that_names_it_and_does_not_say_retry() -> None:
    with (
        serve_asgi(_engine_500) as engine,
        serve_gateway(table({"m": (endpoint("r0", engine),)}), {"s1": GOOD}) as gw,
    ):
        r = httpx.post(
            f"{gw.url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers=AUTH,
            timeout=10,
        )
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "engine_error" and "Internal Server Error" in error["message"]
    assert "retry the request" not in error["message"]


def test_the_engine_receives_the_value_the_gateway_reserved_for() -> None:
    with (
        serve_asgi(_echo_engine) as engine,
        serve_gateway(table({"m": (endpoint("r0", engine),)}), {"s1": GOOD}) as gw,
    ):
        r = httpx.post(
            f"{gw.url}/v1/completions",
            json={"model": "m", "prompt": "x" * 40, "max_tokens": "250", "n": 2.0, "echo": "no"},
            headers=AUTH,
            timeout=10,
        )
        assert r.status_code == 200, r.text
        sent = r.json()["received"]
        assert (sent["max_tokens"], sent["n"], sent["echo"]) == (250, 2, False)
        # The prompt's estimate plus 2 x 250 (it was the estimate plus 16).
        assert gw.limits.admissions[-1].reserve == 40 // CHARS_PER_TOKEN + 500
        r = httpx.post(
            f"{gw.url}/v1/completions",
            json={"model": "m", "prompt": [1, 2**63]},
            headers=AUTH,
            timeout=10,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
