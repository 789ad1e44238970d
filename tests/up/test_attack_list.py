"""The attack list, re-run against one real `llmgw up` (Postgres, the control plane, the agent,
simulator engines): each hostile request the listeners and parsers were hardened against is
answered with its 4xx, a normal chat completion succeeds beside and after them, the whole run
draws no 5xx from any listener, and a secret planted in the attacks is in no reply and no log.

What each attack was before: a ~970-deep JSON body raised RecursionError (a 500) on the
gateway, the admin API and the agent API's registration (no credential needed); a lone
surrogate raised UnicodeEncodeError wherever the body was forwarded or tokenized; a 1 MB header
cost the process CPU quadratic in its size with every listener stalled; idle and trickling
connections were held forever; a literal secret was stored where a reference belongs; a 4 MB
model name was echoed whole in the 404.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.raw_http import closed_within, connect, exchange, status
from tests.up.attacks import ATTACKS
from tests.up.up_harness import Up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HEAD_TIMEOUT_S = 3.0
SECRET = f"sk-planted-{secrets.token_hex(16)}"
DEEP = b"[" * 970 + b"]" * 970  # ~2 KB
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


class Run:
    """The clients of one run, and every status it was answered."""

    def __init__(self, info: dict[str, Any], stack: ExitStack) -> None:
        self.info = info
        self.public_port = int(re.findall(r":(\d+)", info["base_url"])[-1])
        self.internal_port = int(re.findall(r":(\d+)", info["admin_url"])[-1])
        public = info["base_url"].removesuffix("/v1")
        self.gateway = stack.enter_context(
            httpx.Client(
                base_url=public,
                headers={"Authorization": f"Bearer {info['api_key']}"},
                timeout=30,
            )
        )
        self.admin = stack.enter_context(
            httpx.Client(
                base_url=info["admin_url"],
                headers={"Authorization": f"Bearer {info['admin_token']}"},
                timeout=30,
            )
        )
        self.anonymous = stack.enter_context(httpx.Client(base_url=info["admin_url"], timeout=30))
        self.seen: list[tuple[str, int]] = []
        self.http_answers = 0  # answers from an app (each has its access line)

    def expect(self, what: str, r: httpx.Response, want: int) -> httpx.Response:
        self.seen.append((what, r.status_code))
        self.http_answers += 1
        assert r.status_code == want, (what, r.status_code, r.text[:500])
        assert SECRET not in r.text, what
        return r

    def expect_raw(self, what: str, answer: bytes, want: int | None) -> None:
        got = status(answer)
        self.seen.append((what, got or 0))
        assert got == want, (what, answer[:300])
        assert SECRET.encode() not in answer, what

    def chat_ok(self, what: str) -> float:
        started = time.monotonic()
        r = self.expect(what, self.gateway.post("/v1/chat/completions", json=CHAT), 200)
        assert r.json()["choices"][0]["message"]["content"], r.text
        return time.monotonic() - started


def _ascii(body: dict[str, Any]) -> bytes:
    # ensure_ascii writes a lone surrogate as the "\ud800" escape a hostile client sends.
    return json.dumps(body, ensure_ascii=True).encode()


def _nested_json(run: Run) -> None:
    for path, body in (
        ("/v1/chat/completions", b'{"model":"demo","messages":' + DEEP + b"}"),
        ("/v1/completions", b'{"model":"demo","prompt":' + DEEP + b"}"),
    ):
        r = run.gateway.post(path, content=body, headers={"Content-Type": "application/json"})
        assert "64 levels" in run.expect(f"nested {path}", r, 400).text
    # The agent API without any credential: registration parses the body (its token is in
    # it); sync refuses before reading a byte of it.
    r = run.anonymous.post("/agent/v1/register", content=b'{"bootstrap_token":' + DEEP + b"}")
    assert "64 levels" in run.expect("nested register", r, 400).text
    r = run.anonymous.post("/agent/v1/sync", content=b'{"node_id":' + DEEP + b"}")
    run.expect("nested sync", r, 401)
    r = run.admin.post(
        "/admin/v1/models",
        content=b'{"name":"m","description":' + DEEP + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert "64 levels" in run.expect("nested admin", r, 400).text


def _lone_surrogates(run: Run) -> None:
    lone = "\ud800"
    user = {"role": "user", "content": "hi"}
    bodies = {
        "prompt": ("/v1/completions", {"model": "demo", "prompt": lone}),
        "content": (
            "/v1/chat/completions",
            {"model": "demo", "messages": [{**user, "content": lone}]},
        ),
        "role": ("/v1/chat/completions", {"model": "demo", "messages": [{**user, "role": lone}]}),
        "user": ("/v1/chat/completions", {"model": "demo", "messages": [user], "user": lone}),
        "stop": ("/v1/chat/completions", {"model": "demo", "messages": [user], "stop": [lone]}),
    }
    for where, (path, body) in bodies.items():
        for stream in (False, True):
            r = run.gateway.post(
                path,
                content=_ascii({**body, "stream": stream, "max_tokens": 4}),
                headers={"Content-Type": "application/json"},
            )
            assert "surrogate" in run.expect(f"surrogate in {where}", r, 400).text


def _huge_header(run: Run) -> None:
    big = b"X-Big: " + SECRET.encode() + b"a" * (1 << 20) + b"\r\n\r\n"
    answer = exchange(run.public_port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + big)
    run.expect_raw("1 MB header, public", answer, 431)
    # At once: the listener was not stalled by the head it refused.
    assert run.chat_ok("chat after a 1 MB header") < 2.0
    answer = exchange(run.internal_port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + big)
    run.expect_raw("1 MB header, internal", answer, 431)
    started = time.monotonic()
    run.expect("healthz after a 1 MB header", run.anonymous.get("/healthz"), 200)
    assert time.monotonic() - started < 1.0


@contextmanager
def _sockets(port: int, n: int) -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        opened.extend(connect(port) for _ in range(n))
        yield opened
    finally:
        for sock in opened:
            sock.close()


def _idle_and_trickling(run: Run) -> None:
    with _sockets(run.public_port, 500) as idle, _sockets(run.public_port, 1) as (trickler,):
        opened = time.monotonic()
        trickler.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        # Served beside 501 connections that hold a slot and say nothing useful.
        run.chat_ok("chat beside 500 idle connections and a trickler")
        answer = b""
        closed = False
        while not closed and time.monotonic() - opened < HEAD_TIMEOUT_S + 5:
            try:
                trickler.sendall(b"X")  # one byte a second: each arrives long before an idle
            except (BrokenPipeError, ConnectionResetError):  # timeout would fire
                break
            closed, sent = closed_within(trickler, 1.0)
            answer += sent
        took = time.monotonic() - opened
        run.expect_raw("trickled head", answer, 408)
        assert HEAD_TIMEOUT_S - 0.1 <= took < HEAD_TIMEOUT_S + 3, took
        # The idle ones are closed at the same deadline, without a word.
        for sock in idle:
            gone, sent = closed_within(
                sock, max(0.05, opened + HEAD_TIMEOUT_S + 3 - time.monotonic())
            )
            assert gone and sent == b""
    run.chat_ok("chat after the idle connections")


def _literal_secret(run: Run) -> None:
    (profile, *_) = run.expect("profiles", run.admin.get("/admin/v1/profiles"), 200).json()["items"]
    r = run.admin.patch(
        f"/admin/v1/profiles/{profile['name']}",
        json={"version": profile["version"], "secret_env": {"HF_TOKEN": SECRET}},
    )
    assert (
        run.expect("literal secret_env", r, 422).json()["error"]["field"].startswith("secret_env")
    )


def _huge_model_name(run: Run) -> None:
    r = run.gateway.post("/v1/chat/completions", json={**CHAT, "model": "m" * (4 << 20)})
    run.expect("4 MB model name", r, 404)
    assert len(r.content) < 1024, len(r.content)
    # A wrong key is refused without being shown back either.
    r = run.gateway.post(
        "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {SECRET}"}
    )
    run.expect("planted key", r, 401)


def _logs(up: Up) -> dict[Path, str]:
    # Every process's: the control plane's and the agent's in logs/, the shard wrappers' and
    # engines' in the agent's state dir.
    files = [up.out, up.err, *sorted(up.data_dir.rglob("*.log"))]
    return {path: path.read_text(errors="replace") for path in files if path.is_file()}


def _server_errors(text: str, since: datetime) -> tuple[list[str], int]:
    """Access lines with a 5xx status and every error-level line (an unhandled exception is
    one) in one process's JSON log from ``since`` on, and how many access lines it read
    (while `up` brings the demo up, the gateway answers 503 until a replica is ready: that is
    not the run's)."""
    bad = []
    access = 0
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            at = datetime.fromisoformat(entry["timestamp"])
        except (ValueError, KeyError, TypeError):
            continue
        if at < since:
            continue
        code = entry.get("status") if entry.get("event") == "http_request" else None
        access += isinstance(code, int)
        if (isinstance(code, int) and code >= 500) or entry.get("level") in ("error", "critical"):
            bad.append(line[:300])
    return bad, access


def test_the_attack_list_against_a_real_up(pg_tmp_path: Path) -> None:
    settings = {
        "LLMGW_GATEWAY__HEADER_TIMEOUT_S": str(HEAD_TIMEOUT_S),
        "LLMGW_CONTROLPLANE__HEADER_TIMEOUT_S": str(HEAD_TIMEOUT_S),
    }
    up = Up.new(pg_tmp_path).start(env=settings)
    try:
        info = up.wait_up()
        since = datetime.now(UTC)
        with ExitStack() as stack:
            run = Run(info, stack)
            run.chat_ok("chat before")
            _nested_json(run)
            _lone_surrogates(run)
            _huge_header(run)
            _idle_and_trickling(run)
            _literal_secret(run)
            _huge_model_name(run)
            for attack in ATTACKS:
                attack(run)
            run.chat_ok("chat after")
        assert not [seen for seen in run.seen if seen[1] >= 500], run.seen
        logs = _logs(up)
        assert len(logs) >= 6, sorted(logs)  # up's two, two processes', two engines' at least
        access_lines = 0
        for path, text in logs.items():
            assert SECRET not in text, f"the planted secret is in {path}"
            bad, access = _server_errors(text, since)
            assert not bad, (path, bad)
            access_lines += access
        # The scan read the run's requests, not a log format it cannot parse.
        assert access_lines >= run.http_answers, (access_lines, run.http_answers)
    finally:
        up.stop()
