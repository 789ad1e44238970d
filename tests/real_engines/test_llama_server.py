"""llama-server as llmgw's adapter starts it, on the tiny GGUF: what the adapter assumes.

The command is the one ``LlamaCpp.commands`` builds (flags, the key through LLAMA_API_KEY);
then each assumption the rest of llmgw makes about the running server is checked against it:
its health route, that the key is enforced, /tokenize's shape and tokens (the vocabulary's own
BPE, as the `tokenizers` library encodes it), the chat template it applies, streaming with
usage, the prompt cache it reports as ``cached_tokens``, and the metric names the load view
reads. docs/engines.md records what was seen, with the version.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from llmgw.engines import EngineRegistry, EnginesConfig, LlamaCppConfig, Profile, ShardSpec
from tests.support.procs import free_port, stop_process
from tests.support.tiny_gguf import TINY_MODEL_DIR
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine]

KEY = "sk-real-llama-0123456789"
MODEL = "tiny"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    version: str

    def post(self, path: str, body: object, *, key: str = KEY) -> httpx.Response:
        return httpx.post(
            f"{self.url}{path}",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )


def _command(binary: str, gguf: Path, port: int) -> tuple[str, list[str], dict[str, str]]:
    registry = EngineRegistry(EnginesConfig(llamacpp=LlamaCppConfig(path=binary)))
    profile = Profile.model_validate(
        {
            "name": "tiny-cpu",
            "engine": "llamacpp",
            "gpu_class": "cpu",
            "model_path": str(gguf),
            "served_model_name": MODEL,
        }
    )
    spec = ShardSpec.model_validate(
        {
            "replica_id": "r1",
            "shard_id": "s1",
            "http_port": port,
            "profile": profile,
            "threads": 1,
            "api_key": KEY,
        }
    )
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    [cmd] = registry.get("llamacpp").commands(spec, base_env=base)
    return cmd.path, list(cmd.args), dict(cmd.env)


@pytest.fixture(scope="module")
def server(
    llama_server: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    port = free_port()
    path, args, env = _command(llama_server, tiny_gguf, port)
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    version = subprocess.run(
        [path, "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    with log.open("wb") as out:
        proc = subprocess.Popen([path, *args], env=env, stdout=out, stderr=out)
    srv = Server(
        url=f"http://127.0.0.1:{port}",
        proc=proc,
        log=log,
        version=(version.stdout + version.stderr).strip(),
    )
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"llama-server exited:\n{log.read_text()[-3000:]}")
            return httpx.get(f"{srv.url}/health", timeout=2).status_code == 200

        wait_for(healthy, timeout_s=60, what="llama-server /health 200")
        yield srv
    finally:
        stop_process(proc, timeout_s=10)


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))


def _chatml(messages: list[dict[str, str]]) -> str:
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def test_the_key_given_through_the_environment_is_enforced(server: Server) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    assert server.post("/v1/completions", body, key="wrong-key").status_code == 401
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 401, r.text
    assert server.post("/v1/completions", body).status_code == 200


def test_tokenize_answers_the_vocabularys_own_bpe(server: Server) -> None:
    text = "The quick brown fox asks: what is the capital of France? 2026"
    r = server.post("/tokenize", {"content": text})
    assert r.status_code == 200, r.text
    expected = _tokenizer().encode(text, add_special_tokens=False).ids
    assert r.json()["tokens"] == expected


def test_chat_applies_the_models_template_and_reports_usage(server: Server) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello! How are you today?"},
    ]
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    rendered = _tokenizer().encode(_chatml(messages), add_special_tokens=False).ids
    assert usage["prompt_tokens"] == len(rendered)
    assert 1 <= usage["completion_tokens"] <= 4


def test_a_repeated_prompt_is_reported_as_cached(server: Server) -> None:
    messages = [{"role": "user", "content": "Each replica holds the prefix of a prompt. " * 6}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    first = server.post("/v1/chat/completions", body).json()["usage"]
    second = server.post("/v1/chat/completions", body).json()["usage"]
    cached = (second.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached >= first["prompt_tokens"] // 2, (first, second)


def test_streams_chunks_then_usage_then_done(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] >= 1


def test_metrics_carry_the_names_the_load_view_reads(server: Server) -> None:
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
    assert r.status_code == 200, r.text
    names = {
        line.split("{")[0].split()[0]
        for line in r.text.splitlines()
        if line and not line.startswith("#")
    }
    assert {"llamacpp:requests_processing", "llamacpp:requests_deferred"} <= names, names
