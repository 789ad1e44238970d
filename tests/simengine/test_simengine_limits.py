"""One request must not freeze or kill a real `llmgw simengine` ([hardening] item 6).

Each reproduction from the issue is sent to a real process: it must get a fast 4xx naming the
right `param`, the process's RSS must stay bounded, and a normal request must work right after.
Client timeouts are short on purpose: against the old engine these requests hung or grew the
process by gigabytes, and the test must fail rather than wait for that.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.simengine.sim_process import SimProcess

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 32768
MIB = 1024 * 1024
CAP = 16 * MIB  # the engine's default --max-body-bytes


@pytest.fixture(scope="module")
def sim(sim_factory: Callable[..., SimProcess]) -> SimProcess:
    return sim_factory("--served-model-name", "sim", "--max-model-len", str(MAX_MODEL_LEN))


def _rss_mb(sim: SimProcess) -> float:
    with open(f"/proc/{sim.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


def _post(sim: SimProcess, path: str, body: Any, timeout: float = 5) -> httpx.Response:
    # float("inf") is sent as 1e999: valid JSON that parses to inf, as a client could send it.
    content = json.dumps(body).replace("Infinity", "1e999")
    return httpx.post(
        f"{sim.base_url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=timeout,
    )


def _assert_serves(sim: SimProcess) -> None:
    """The process is alive and a normal request right after still completes."""
    assert sim.proc.poll() is None, f"the engine exited:\n{sim.log()[-3000:]}"
    ok = _post(sim, "/v1/completions", {"prompt": "still here", "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_huge_max_tokens_is_refused_before_any_output_is_drawn(sim: SimProcess) -> None:
    before = _rss_mb(sim)
    started = time.monotonic()
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1_000_000_000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 1_000_000_000}),
    ):  # fmt: skip
        error = _error(_post(sim, path, body, timeout=3), 400)
        assert error["param"] == "max_tokens"
        assert "maximum context length is 32768 tokens" in error["message"]
    assert time.monotonic() - started < 2
    assert _rss_mb(sim) - before < 50
    _assert_serves(sim)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"max_tokens": 2**64}, "max_tokens", "too large"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens", "32768 - "),
        ({"seed": 2**64}, "seed", "64-bit"),
        ({"seed": -(2**63) - 1}, "seed", "64-bit"),
        ({"n": 0}, "n", "at least 1"),
        ({"temperature": -0.5}, "temperature", "non-negative"),
        ({"temperature": float("inf")}, "temperature", "finite"),
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "at least 1"),
        ({"min_p": 2}, "min_p", "[0, 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than zero"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "max_tokens=4"),
        ({"logprobs": 21}, "logprobs", "between 0 and 20"),
        ({"stop": [""]}, "stop", "empty string"),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "at most 1024"),
        ({"temperature": "hot"}, "temperature", "valid number"),
    ],
)
def test_completion_parameters_are_checked_as_vllm_does(
    sim: SimProcess, body: dict[str, Any], param: str, words: str
) -> None:
    error = _error(_post(sim, "/v1/completions", {"prompt": "hi", "max_tokens": 4} | body), 400)
    assert error["param"] == param and words in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "between 0 and 20"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs", "between 0 and 20"),
        ({"top_logprobs": 5}, "top_logprobs", "`logprobs` must be set to true"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
        ({"max_completion_tokens": 2**64}, "max_completion_tokens", "too large"),
    ],
)
def test_chat_parameters_are_checked_as_vllm_does(
    sim: SimProcess, body: dict[str, Any], param: str, words: str
) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]} | body
    error = _error(_post(sim, "/v1/chat/completions", chat), 400)
    assert error["param"] == param and words in error["message"]


def test_out_of_range_token_ids_are_400s(sim: SimProcess) -> None:
    for tokens in ([75_600], [2**64], [-1]):
        error = _error(_post(sim, "/detokenize", {"tokens": tokens}), 400)
        assert error["param"] == "tokens" and "outside" in error["message"]
        error = _error(_post(sim, "/v1/completions", {"prompt": tokens, "max_tokens": 1}), 400)
        assert error["param"] == "prompt" and "outside the vocabulary" in error["message"]
    assert _error(_post(sim, "/v1/completions", ["hi"]), 400)["message"].startswith("body: ")


def test_valid_sampling_parameters_are_accepted(sim: SimProcess) -> None:
    ok = _post(
        sim,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3,
            "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "seed": 2**63 - 1,
            "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1.1,
            "min_tokens": 3, "logprobs": True, "top_logprobs": 20, "stop": ["zzzzz"],
        },
    )  # fmt: skip
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3


def test_an_overlong_prompt_names_the_prompt_not_max_tokens(sim: SimProcess) -> None:
    long_text = "word " * MAX_MODEL_LEN  # ~2 tokens per "word ", so well over the limit
    error = _error(_post(sim, "/v1/completions", {"prompt": long_text, "max_tokens": 1}), 400)
    assert error["param"] == "prompt"
    assert "maximum context length is 32768 tokens. However, your request has" in error["message"]
    chat = {"messages": [{"role": "user", "content": long_text}]}
    error = _error(_post(sim, "/v1/chat/completions", chat), 400)
    assert error["param"] == "messages"
    ids = {"prompt": [7] * MAX_MODEL_LEN, "max_tokens": 1}
    assert _error(_post(sim, "/v1/completions", ids), 400)["param"] == "prompt"
    _assert_serves(sim)


def test_deeply_nested_json_is_a_400_not_a_500(sim: SimProcess) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        response = httpx.post(
            f"{sim.base_url}{path}",
            content=deep,
            headers={"content-type": "application/json"},
            timeout=5,
        )
        assert "nests" in _error(response, 400)["message"], path
    # 64 levels (body, messages, message, 61 lists) pass, 65 do not; brackets inside strings
    # do not count.
    nested: Any = "[" * 80
    for _ in range(61):
        nested = [nested]
    body = {"messages": [{"role": "user", "content": "hi", "extra": nested}], "max_tokens": 2}
    assert _post(sim, "/v1/chat/completions", body).status_code == 200
    body["messages"][0]["extra"] = [nested]
    assert "64 levels" in _error(_post(sim, "/v1/chat/completions", body), 400)["message"]
    _assert_serves(sim)


def _raw_request(
    sim: SimProcess, head: bytes, body_parts: Iterator[bytes], timeout: float = 5
) -> bytes:
    """Send a request from a thread (the server may answer before it has read the body)
    and return the raw response head."""
    host, port = sim.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as conn:

        def sender() -> None:
            try:
                conn.sendall(head)
                for part in body_parts:
                    conn.sendall(part)
            except OSError:
                pass  # the server answered and closed before taking the rest: expected

        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = conn.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


def test_a_body_over_the_cap_is_refused_413_without_being_buffered(sim: SimProcess) -> None:
    before = _rss_mb(sim)
    # Declared too large: refused on the headers, before a byte of the 50 MB is sent.
    for path in ("/v1/completions", "/tokenize"):
        head = (
            f"POST {path} HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 * MIB}\r\n\r\n"
        ).encode()
        started = time.monotonic()
        response = _raw_request(sim, head, iter([b'{"prompt": "']))
        assert response.startswith(b"HTTP/1.1 413 "), response[:200]
        assert time.monotonic() - started < 2

    # No Content-Length (chunked): counted while it streams in and cut off at the cap.
    def chunked() -> Iterator[bytes]:
        payload = b"x" * MIB
        yield b'{"prompt": "'
        for _ in range(CAP // MIB + 2):
            yield f"{len(payload):x}\r\n".encode() + payload + b"\r\n"
        yield b"0\r\n\r\n"

    parts = chunked()
    first = next(parts)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(first):x}\r\n".encode() + first + b"\r\n"
    )
    response = _raw_request(sim, head, parts)
    assert response.startswith(b"HTTP/1.1 413 "), response[:200]
    assert _rss_mb(sim) - before < 50
    _assert_serves(sim)


def test_a_large_allowed_prompt_does_not_block_other_requests(sim: SimProcess) -> None:
    """Tokenizing ~4 MB takes ~0.5 s of CPU; the loop must keep answering meanwhile."""
    prompt = "Hello world abc " * (4 * MIB // 16)
    result: dict[str, Any] = {}

    def big() -> None:
        started = time.monotonic()
        response = httpx.post(
            f"{sim.base_url}/v1/completions",
            content=json.dumps({"prompt": prompt, "max_tokens": 1}),
            headers={"content-type": "application/json"},
            timeout=30,
        )
        result["seconds"] = time.monotonic() - started
        result["response"] = response

    thread = threading.Thread(target=big)
    latencies: list[float] = []
    with httpx.Client(base_url=sim.base_url, timeout=10) as client:
        client.get("/health")  # connect first, so latencies measure the loop, not the connect
        thread.start()
        while thread.is_alive():
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
    thread.join()
    # Blocked, one /health would wait out the whole tokenization; a worker thread gives the
    # loop a turn every few ms (the GIL's switch interval) instead.
    assert len(latencies) >= 5 and max(latencies) < result["seconds"] / 4, (latencies, result)
    assert _error(result["response"], 400)["param"] == "prompt"
    _assert_serves(sim)
