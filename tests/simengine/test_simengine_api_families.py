"""The Responses, Messages and embeddings routes of a real `llmgw simengine` process: through
the official openai client (responses, embeddings) and raw HTTP (messages, whose client is
not installed here), streamed and not, with their stores, errors and prefix-cache usage."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.simengine.sim_process import API_KEY, SimProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

MODEL = "sim"
BLOCK = 16
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def sim(sim_factory: Callable[..., SimProcess]) -> SimProcess:
    return sim_factory("--served-model-name", MODEL, env={"SIMENGINE_API_KEY": API_KEY})


@pytest.fixture(scope="module")
def slow_sim(sim_factory: Callable[..., SimProcess]) -> SimProcess:
    """Another process (its own store), 50 ms a step so a request is still running when
    cancelled, and a small body cap."""
    return sim_factory(
        "--served-model-name", MODEL,
        "--step-overhead-ms", "50",
        "--max-body-bytes", "65536",
        env={"SIMENGINE_API_KEY": API_KEY},
    )  # fmt: skip


def _client(sim: SimProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key=API_KEY, max_retries=0)


def _unique(label: str) -> str:
    # The marker leads, so even a prompt's first block is this test's own (no cache hit from
    # another test's request on the same engine).
    return f"{time.monotonic_ns()} {label}"


def _chat_tokens(sim: SimProcess, messages: list[dict[str, Any]]) -> int:
    response = httpx.post(f"{sim.base_url}/tokenize", json={"messages": messages})
    return int(response.json()["count"])


def _post(sim: SimProcess, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{sim.base_url}{path}", json=body, headers=headers or AUTH, timeout=30)


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    """Every event of a stream, checking each `event:` line names its data's type."""
    events = []
    for frame in response.text.split("\n\n"):
        if not frame.strip():
            continue
        lines = frame.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        data = json.loads(lines[1].removeprefix("data: "))
        assert data["type"] == lines[0].removeprefix("event: ")
        events.append(data)
    return events


# ---- Responses ------------------------------------------------------------------------------


def test_openai_sdk_responses_stored_streamed_and_chained(sim: SimProcess) -> None:
    client = _client(sim)
    rules, question = "Answer briefly.", _unique("What is a cache?")
    first = client.responses.create(model=MODEL, instructions=rules, input=question)
    # No limit sent: the answer ends at its natural length, well inside the context.
    assert first.status == "completed" and first.output_text
    assert first.model == MODEL and first.id.startswith("resp_")
    usage = first.usage
    assert usage is not None
    history = [{"role": "system", "content": rules}, {"role": "user", "content": question}]
    assert usage.input_tokens == _chat_tokens(sim, history)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0

    stored = client.responses.retrieve(first.id)
    assert stored.output_text == first.output_text and stored.usage == first.usage

    # The follow-up renders the history, then the answer, then the new input: the first
    # prompt's full blocks (and the answer's) are served by the prefix cache.
    second = client.responses.create(
        model=MODEL, instructions=rules, input="And why?", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id and second.usage is not None
    history += [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And why?"},
    ]
    assert second.usage.input_tokens == _chat_tokens(sim, history)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached % BLOCK == 0 and usage.input_tokens // BLOCK * BLOCK <= cached
    assert cached < second.usage.input_tokens

    # Streamed: vLLM's event sequence, numbered, the deltas adding up to the stored text.
    stream = client.responses.create(
        model=MODEL, input=_unique("Stream a story"), max_output_tokens=12, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == len(kinds) - 8 and deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response  # type: ignore[union-attr]
    assert done.output_text == "".join(deltas) and done.usage is not None
    # A natural answer is at least 16 tokens: the limit of 12 cuts it.
    assert done.usage.output_tokens == len(deltas) == 12 and done.status == "incomplete"
    assert client.responses.retrieve(done.id).output_text == done.output_text


def test_openai_sdk_embeddings(sim: SimProcess) -> None:
    client = _client(sim)
    texts = ["the quick brown fox", "a slow green turtle"]
    # The client asks for base64 unless told otherwise, and decodes it.
    packed = client.embeddings.create(model=MODEL, input=texts)
    plain = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.embedding for d in packed.data] == [d.embedding for d in plain.data]
    for item in plain.data:
        assert len(item.embedding) == 384
        assert math.isclose(math.fsum(x * x for x in item.embedding), 1.0, rel_tol=1e-5)
    assert plain.data[0].embedding != plain.data[1].embedding
    again = client.embeddings.create(model=MODEL, input=texts[1], encoding_format="float")
    assert again.data[0].embedding == plain.data[1].embedding  # deterministic
    counts = [
        httpx.post(f"{sim.base_url}/tokenize", json={"prompt": t}).json()["count"] for t in texts
    ]
    assert plain.usage.prompt_tokens == plain.usage.total_tokens == sum(counts)
    short = client.embeddings.create(model=MODEL, input=[[5, 6, 7]], dimensions=64)
    assert len(short.data[0].embedding) == 64 and short.usage.prompt_tokens == 3
    assert math.isclose(math.fsum(x * x for x in short.data[0].embedding), 1.0, rel_tol=1e-5)


def test_a_response_renders_as_the_chat_it_converts_to_and_shares_its_cache(
    sim: SimProcess,
) -> None:
    rules, question = "You are a cache.", _unique("Repeat after me: " + "block " * 30)
    chat = _post(
        sim,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": rules},
                {"role": "user", "content": question},
            ],
            "max_tokens": 1,
        },
    ).json()
    prompt = chat["usage"]["prompt_tokens"]
    body = _post(
        sim, "/v1/responses", {"model": MODEL, "instructions": rules, "input": question}
    ).json()
    assert body["usage"]["input_tokens"] == prompt
    # Chat's blocks serve it, capped one token short of the prompt as vLLM caps a hit.
    details = body["usage"]["input_tokens_details"]
    assert details["cached_tokens"] == (prompt - 1) // BLOCK * BLOCK > 0
    assert details["cache_write_tokens"] == prompt // BLOCK * BLOCK - details["cached_tokens"]


def test_the_store_answers_get_cancel_and_unknown_ids_as_vllm(sim: SimProcess) -> None:
    created = _post(sim, "/v1/responses", {"input": _unique("hello"), "max_output_tokens": 3})
    assert created.status_code == 200
    body = created.json()
    assert body["status"] == "incomplete" and body["max_output_tokens"] == 3
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    response_id = body["id"]

    refused = _post(sim, f"/v1/responses/{response_id}/cancel", None)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("Cannot cancel a synchronous response.")

    unstored = _post(sim, "/v1/responses", {"input": "not kept", "store": False}).json()
    for method, path, payload in (
        ("GET", f"/v1/responses/{unstored['id']}", None),
        ("GET", "/v1/responses/resp_nope", None),
        ("POST", "/v1/responses/resp_nope/cancel", None),
        ("POST", "/v1/responses", {"input": "x", "previous_response_id": "resp_nope"}),
    ):
        missing = httpx.request(method, f"{sim.base_url}{path}", json=payload, headers=AUTH)
        assert missing.status_code == 404, (method, path)
        error = missing.json()["error"]
        assert error["param"] == "response_id" and "not found" in error["message"]

    assert (
        httpx.delete(f"{sim.base_url}/v1/responses/{response_id}", headers=AUTH).status_code == 405
    )
    assert httpx.get(f"{sim.base_url}/v1/responses/a/b", headers=AUTH).status_code == 404
    streamed_get = httpx.get(f"{sim.base_url}/v1/responses/{response_id}?stream=true", headers=AUTH)
    assert streamed_get.status_code == 400
    assert httpx.get(f"{sim.base_url}/v1/responses/{response_id}").status_code == 401
    tool_call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    bad = _post(sim, "/v1/responses", {"input": [tool_call]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_a_background_response_can_be_cancelled_and_frees_the_engine(slow_sim: SimProcess) -> None:
    queued = _post(
        slow_sim,
        "/v1/responses",
        {"input": _unique("a long answer"), "background": True, "max_output_tokens": 200},
    ).json()
    assert queued["status"] == "queued" and queued["output"] == [] and queued["usage"] is None
    cancelled = _post(slow_sim, f"/v1/responses/{queued['id']}/cancel", None)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"

    def idle() -> bool:
        counts = httpx.get(f"{slow_sim.base_url}/debug/kv_blocks").json()["counts"]
        return bool(counts["running"] == 0 and counts["waiting"] == 0)

    wait_for(idle, timeout_s=10, what="the cancelled response's request to leave the engine")
    got = httpx.get(f"{slow_sim.base_url}/v1/responses/{queued['id']}", headers=AUTH).json()
    assert got["status"] == "cancelled"
    again = _post(slow_sim, f"/v1/responses/{queued['id']}/cancel", None)
    assert again.status_code == 400

    finishing = _post(
        slow_sim,
        "/v1/responses",
        {"input": _unique("short"), "background": True, "max_output_tokens": 4},
    ).json()

    def finished() -> dict[str, Any] | None:
        body = httpx.get(f"{slow_sim.base_url}/v1/responses/{finishing['id']}", headers=AUTH).json()
        return body if body["status"] != "queued" else None

    done = wait_for(finished, timeout_s=10, what="the background response to finish")
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 4


def test_a_stored_response_lives_only_in_the_process_that_made_it(
    sim: SimProcess, slow_sim: SimProcess
) -> None:
    made = _post(sim, "/v1/responses", {"input": _unique("remember me"), "max_output_tokens": 2})
    follow = {"input": "again", "previous_response_id": made.json()["id"]}
    assert _post(slow_sim, "/v1/responses", follow).status_code == 404
    assert _post(sim, "/v1/responses", {**follow, "max_output_tokens": 2}).status_code == 200


# ---- Messages -------------------------------------------------------------------------------


def _message_body(question: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        # Above the longest natural answer (256 tokens): a ceiling, not a length.
        "max_tokens": 300,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}],
        **fields,
    }


def test_messages_streamed_and_not_with_cache_usage(sim: SimProcess) -> None:
    question = _unique("Tell me about caches, " + "please " * 20)
    body = _message_body(question)
    prompt = _chat_tokens(
        sim,
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": question}],
    )
    counted = _post(
        sim, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"}
    )
    assert counted.json() == {
        "input_tokens": prompt,
        "context_management": {"original_input_tokens": prompt},
    }

    first = _post(sim, "/v1/messages", body).json()
    assert first["id"].startswith("msg_") and first["type"] == "message"
    assert first["role"] == "assistant" and first["model"] == MODEL
    assert first["content"][0]["type"] == "text" and first["content"][0]["text"]
    assert first["stop_reason"] == "end_turn" and first["stop_sequence"] is None
    usage = first["usage"]
    assert 16 <= usage["output_tokens"] <= 256
    assert usage["cache_read_input_tokens"] == 0
    assert usage["cache_creation_input_tokens"] == prompt // BLOCK * BLOCK
    assert usage["input_tokens"] + usage["cache_creation_input_tokens"] == prompt

    streamed = _post(sim, "/v1/messages", {**body, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = _sse(streamed)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0]["message"]
    assert start["usage"] == {"input_tokens": prompt, "output_tokens": 0} and start["content"] == []
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == first["content"][0]["text"]  # same prompt, same deterministic answer
    ending = events[-2]
    assert ending["delta"]["stop_reason"] == first["stop_reason"]
    repeated = ending["usage"]
    # The same prompt again: its full blocks come from the cache, one token short as vLLM caps.
    assert repeated["cache_read_input_tokens"] == (prompt - 1) // BLOCK * BLOCK > 0
    assert (
        repeated["input_tokens"]
        + repeated["cache_read_input_tokens"]
        + repeated["cache_creation_input_tokens"]
        == prompt
    )
    assert repeated["output_tokens"] == first["usage"]["output_tokens"]

    stop = text[4:8]
    cut = _post(sim, "/v1/messages", {**body, "stop_sequences": [stop]}).json()
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    assert cut["content"][0]["text"] == text[: text.find(stop)]


def test_messages_errors_have_anthropics_shape(sim: SimProcess) -> None:
    def error(response: httpx.Response, status: int, kind: str) -> str:
        assert response.status_code == status, response.text
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == kind
        assert set(body["error"]) == {"type", "message"}
        return str(body["error"]["message"])

    no_limit = {k: v for k, v in _message_body("hi").items() if k != "max_tokens"}
    assert "max_tokens" in error(_post(sim, "/v1/messages", no_limit), 400, "invalid_request_error")
    zero = _message_body("hi", max_tokens=0)
    assert "must be positive" in error(
        _post(sim, "/v1/messages", zero), 400, "invalid_request_error"
    )
    unknown = _message_body("hi", model="claude-nope")
    assert "does not exist" in error(_post(sim, "/v1/messages", unknown), 404, "not_found_error")
    image = {"type": "image", "source": {"type": "url", "url": "http://x"}}
    pictured = _message_body("hi", messages=[{"role": "user", "content": [image]}])
    assert "'image' block" in error(
        _post(sim, "/v1/messages", pictured), 400, "invalid_request_error"
    )
    # vLLM's --api-key reads Authorization: Bearer only: an x-api-key alone is refused.
    keyed = httpx.post(
        f"{sim.base_url}/v1/messages", json=_message_body("hi"), headers={"x-api-key": API_KEY}
    )
    assert "Authorization: Bearer" in error(keyed, 401, "authentication_error")
    counted = httpx.post(f"{sim.base_url}/v1/messages/count_tokens", json={"messages": []})
    error(counted, 401, "authentication_error")
    broken = httpx.post(f"{sim.base_url}/v1/messages", content=b"{not json", headers=AUTH)
    assert "not JSON" in error(broken, 400, "invalid_request_error")
    assert "POST" in error(
        httpx.get(f"{sim.base_url}/v1/messages", headers=AUTH), 405, "invalid_request_error"
    )
    no_model = _post(sim, "/v1/messages/count_tokens", {"messages": []})
    assert "model" in error(no_model, 400, "invalid_request_error")


# ---- every new route under the body limits ---------------------------------------------------


ROUTES = {
    "/v1/responses": {"input": "x", "max_output_tokens": 2},
    "/v1/messages": _message_body("x", max_tokens=2),
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
    "/v1/embeddings": {"input": "x"},
}


def _shape_ok(path: str, response: httpx.Response) -> str:
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        return str(body["error"]["message"])
    return str(body["error"]["message"])


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_new_route_refuses_deep_oversized_and_surrogate_bodies(
    slow_sim: SimProcess, route: str
) -> None:
    deep = b'{"input": ' + b"[" * 970 + b"]" * 970 + b"}"
    response = httpx.post(f"{slow_sim.base_url}{route}", content=deep, headers=AUTH)
    assert response.status_code == 400 and "nest" in _shape_ok(route, response)
    huge = json.dumps({**ROUTES[route], "pad": "x" * 70_000}).encode()
    response = httpx.post(f"{slow_sim.base_url}{route}", content=huge, headers=AUTH)
    assert response.status_code == 413 and "--max-body-bytes" in _shape_ok(route, response)
    surrogate = json.dumps(ROUTES[route]).encode().replace(b'"x"', rb'"\ud800"')
    if surrogate != json.dumps(ROUTES[route]).encode():
        response = httpx.post(f"{slow_sim.base_url}{route}", content=surrogate, headers=AUTH)
        assert response.status_code == 400 and "surrogate" in _shape_ok(route, response)
    ok = httpx.post(f"{slow_sim.base_url}{route}", json=ROUTES[route], headers=AUTH, timeout=30)
    assert ok.status_code == 200, ok.text


def test_embeddings_errors_name_the_field(sim: SimProcess) -> None:
    def error(body: dict[str, Any], status: int = 400) -> dict[str, Any]:
        response = _post(sim, "/v1/embeddings", body)
        assert response.status_code == status, response.text
        return dict(response.json()["error"])

    assert error({"input": "x", "dimensions": 385})["param"] == "dimensions"
    assert error({"input": "x", "encoding_format": "bytes"})["param"] == "encoding_format"
    assert error({"input": []})["param"] == "input"
    assert error({"input": [[]]})["param"] == "input"
    assert "outside the vocabulary" in error({"input": [[10**7]]})["message"]
    assert error({"input": "x", "model": "nope"}, 404)["param"] == "model"
    too_long = error({"input": "word " * 40_000})
    assert "maximum context length is 32768" in too_long["message"]
