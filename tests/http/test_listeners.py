"""`llmgw controlplane` serves two listeners from one process: the admin API only on the
internal one, the OpenAI surface only on the public one, and one SIGTERM stops both."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.procs import free_port, llmgw_cmd, stop_process, wait_http_ok

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@dataclass(frozen=True)
class _Cp:
    internal: str
    public: str
    headers: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: Path
    db_url: str


def _start(db_url: str, log: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    token = secrets.token_urlsafe(24)
    env = dict(
        os.environ,
        LLMGW_CONTROLPLANE__DATABASE_URL=db_url,
        LLMGW_CONTROLPLANE__ADMIN_TOKEN=token,
        LLMGW_LOG__JSON="true",
    )
    with log.open("ab") as out:
        proc = subprocess.Popen(llmgw_cmd("controlplane", *args), env=env, stdout=out, stderr=out)
    return proc, token


@pytest.fixture
def two_listeners(db_url: str, tmp_path: Path) -> Iterator[_Cp]:
    port, public_port = free_port(), free_port()
    log = tmp_path / "cp.log"
    proc, token = _start(
        db_url, log, "--port", str(port), "--public-host", "127.0.0.1",
        "--public-port", str(public_port),
    )  # fmt: skip
    try:
        internal = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{internal}/readyz", timeout_s=30, proc=proc, log=log)
        yield _Cp(
            internal=internal,
            public=f"http://127.0.0.1:{public_port}",
            headers={"Authorization": f"Bearer {token}"},
            proc=proc,
            log=log,
            db_url=db_url,
        )
    finally:
        stop_process(proc)


def test_admin_api_answers_on_the_internal_listener_only(two_listeners: _Cp) -> None:
    cp = two_listeners
    assert httpx.get(f"{cp.internal}/admin/v1/models", headers=cp.headers).status_code == 200
    for path in ("/admin/v1/models", "/docs", "/openapi.json", "/readyz"):
        r = httpx.get(f"{cp.public}{path}", headers=cp.headers)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(f"{cp.public}/admin/v1/models", headers=cp.headers, json={"name": "x"})
    assert r.status_code == 404
    assert httpx.get(f"{cp.public}/healthz").json() == {"status": "ok"}


def test_public_listener_speaks_openai_errors(two_listeners: _Cp) -> None:
    cp = two_listeners
    r = httpx.post(
        f"{cp.public}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    # The gateway checks the API key before anything else, in OpenAI's error shape.
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "invalid_api_key"
    assert r.headers["x-request-id"]
    assert httpx.get(f"{cp.public}/v1/models").status_code == 401
    r = httpx.delete(f"{cp.public}/v1/models")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_sigterm_stops_both_listeners_gracefully(two_listeners: _Cp) -> None:
    cp = two_listeners
    cp.proc.send_signal(signal.SIGTERM)
    assert cp.proc.wait(timeout=20) == 0, cp.log.read_text()[-2000:]
    for url in (cp.internal, cp.public):
        host, port = url.removeprefix("http://").split(":")
        with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=1):
            pass


def test_a_taken_public_port_fails_at_start_naming_the_setting(db_url: str, tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        log = tmp_path / "cp.log"
        proc, _ = _start(db_url, log, "--port", str(free_port()), "--public-port", str(taken))
        try:
            code = proc.wait(timeout=30)
        finally:
            stop_process(proc)
    assert code != 0
    text = log.read_text()
    assert "gateway.port" in text and str(taken) in text, text[-2000:]


def test_the_internal_openapi_document_lists_every_public_route(two_listeners: _Cp) -> None:
    cp = two_listeners
    listed = httpx.get(f"{cp.internal}/openapi.json").json()["x-llmgw-public-routes"]
    routes = {(r["method"], r["path"]) for r in listed}
    assert ("POST", "/v1/responses") in routes and ("POST", "/v1/embeddings") in routes
    # Each is served by the public listener: the key is asked for (401), never "no such
    # route" (404), in the family's own error shape.
    for r in listed:
        path = r["path"].replace("{id}", "resp_x")
        answer = httpx.request(r["method"], f"{cp.public}{path}", json={})
        assert answer.status_code == 401, (r, answer.text)
        body = answer.json()
        if r["errors"] == "anthropic":
            assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        else:
            assert body["error"]["code"] == "invalid_api_key", body
