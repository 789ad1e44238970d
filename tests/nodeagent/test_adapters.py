"""Adapter downloads against a real HTTP server on 127.0.0.1: cap, checksum, redirects refused."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from llmgw.nodeagent.adapters import AdapterFetchError, adapter_path_for, fetch_adapter

PAYLOAD = b"lora-weights-" * 100


class _Handler(BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        if self.path == "/a.safetensors":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PAYLOAD)))
            self.end_headers()
            self.wfile.write(PAYLOAD)
        elif self.path == "/to-metadata":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.end_headers()
        elif self.path == "/to-a":
            self.send_response(301)
            self.send_header("Location", "/a.safetensors")
            self.end_headers()
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def _fetch(source: str, root: Path, **kw: object) -> Path:
    return asyncio.run(fetch_adapter(source, root, **{"max_bytes": 1 << 20, **kw}))  # type: ignore[arg-type]


def test_fetch_stores_by_hash_of_source_once(server: str, tmp_path: Path) -> None:
    src = f"{server}/a.safetensors#sha256={hashlib.sha256(PAYLOAD).hexdigest()}"
    path = _fetch(src, tmp_path, allow_loopback=True)
    assert path == adapter_path_for(src, tmp_path) and path.read_bytes() == PAYLOAD
    hits = _Handler.hits
    assert _fetch(src, tmp_path, allow_loopback=True) == path
    assert _Handler.hits == hits  # stored: not fetched again
    # A same-host redirect is followed.
    assert _fetch(f"{server}/to-a", tmp_path, allow_loopback=True).read_bytes() == PAYLOAD


@pytest.mark.parametrize(
    ("path", "kw", "needle"),
    [
        ("/a.safetensors", {}, "never fetched from the node itself"),
        ("/to-metadata", {"allow_loopback": True}, "cloud-metadata"),
        ("/a.safetensors", {"allow_loopback": True, "max_bytes": 100}, "adapter_max_bytes"),
        ("/a.safetensors#sha256=" + "0" * 64, {"allow_loopback": True}, "expected 000"),
        ("/missing", {"allow_loopback": True}, "answered 404"),
        ("/loop", {"allow_loopback": True}, "redirects"),
    ],
)
def test_refusals(
    server: str, tmp_path: Path, path: str, kw: dict[str, object], needle: str
) -> None:
    with pytest.raises(AdapterFetchError, match=needle):
        _fetch(server + path, tmp_path, **kw)
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing partial left behind
