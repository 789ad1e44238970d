"""A shard's front door (llmgw/nodeagent/frontdoor.py), served by a real `llmgw shard-run`
wrapper in front of a small HTTP server standing in for the engine.

What it must guarantee: the proxy's checks hold in the wrapper (the key before a byte of the
body, only this shard's allowed paths, the body cap, the metrics token for GET /metrics only);
where it listens is in procs.json before any command runs, read back by an agent that adopts
the shard; it closes with its shard; and a port it cannot bind fails the launch before the
engine starts.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from llmgw.nodeagent.exits import refresh_engine_pid
from llmgw.nodeagent.frontdoor import FrontDoorLaunch
from llmgw.nodeagent.records import ShardRecord, read_exit, read_procs
from llmgw.nodeagent.runtime import ShardRuntime
from llmgw.nodeagent.shardrun import EXIT_LAUNCH_FAILED
from tests.nodeagent.test_shardrun import Wrapper, _py
from tests.support.procs import free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

KEY = "shard-key-0123456789"
SCRAPE = "scrape-token-0123456789"

# Answers every path with the path and the body's length: what reached the engine.
_ENGINE = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        body = json.dumps({"path": self.path, "bytes": n}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _answer
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _front_door(tmp: Path, port: int) -> tuple[Wrapper, str]:
    engine_port = free_port()
    engine = _py("engine", _ENGINE)
    engine = engine.model_copy(update={"args": (*engine.args, str(engine_port))})
    w = Wrapper(
        tmp,
        [engine],
        proxy=FrontDoorLaunch(
            host="127.0.0.1",
            port=port,
            upstream_port=engine_port,
            api_key=KEY,
            metrics_token=SCRAPE,
            max_body_bytes=4096,
            max_connections=64,
        ),
    )
    return w, f"http://127.0.0.1:{port}/shards/{w.shard_id}"


def _auth(token: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _exchange(port: int, head: bytes) -> bytes:
    """Send a request head alone (no body) and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head)
        return s.recv(65536)


def test_the_wrapper_serves_its_shards_front_door_with_the_proxys_checks(
    tmp_path: Path,
) -> None:
    port = free_port()
    w, url = _front_door(tmp_path, port)
    try:
        # Recorded before the engine runs: an agent adopting the shard later finds it here.
        p = wait_for(lambda: read_procs(w.dir), timeout_s=20, what="procs.json")
        assert (p.proxy_host, p.proxy_port) == ("127.0.0.1", port)
        r = wait_for(
            lambda: (x := httpx.get(f"{url}/v1/models", headers=_auth())).status_code == 200 and x,
            timeout_s=20,
            what="the engine through its front door",
        )
        assert r.json() == {"path": "/v1/models", "bytes": 0}
        posted = httpx.post(f"{url}/v1/completions", headers=_auth(), content=b"x" * 100)
        assert posted.json() == {"path": "/v1/completions", "bytes": 100}

        # The key before a byte of the body: a 1 MiB body is declared and never sent, and the
        # answer comes at once.
        t0 = time.monotonic()
        answer = _exchange(
            port,
            f"POST /shards/{w.shard_id}/v1/completions HTTP/1.1\r\nHost: x\r\n"
            "Authorization: Bearer wrong\r\nContent-Length: 1048576\r\n\r\n".encode(),
        )
        assert answer.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 2
        assert httpx.get(f"{url}/v1/models").status_code == 401
        # Only this shard, only the engine paths the gateway needs.
        other = f"http://127.0.0.1:{port}/shards/another-shard/v1/models"
        assert httpx.get(other, headers=_auth()).status_code == 404
        assert httpx.post(f"{url}/suspend", headers=_auth()).status_code == 404
        assert httpx.get(f"{url}/v1/..%2f..%2fadmin", headers=_auth()).status_code == 404
        # The body cap from the launch.
        big = httpx.post(f"{url}/v1/completions", headers=_auth(), content=b"x" * 5000)
        assert big.status_code == 413
        # The metrics token scrapes, and does nothing else.
        assert httpx.get(f"{url}/metrics", headers=_auth(SCRAPE)).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers=_auth(SCRAPE)).status_code == 401

        # An agent that adopts the shard reads the front door back, asking nothing of it.
        rt = ShardRuntime(
            shard_id=w.shard_id,
            dir=w.dir,
            record=ShardRecord(shard_id=w.shard_id, digest="d", spec={}),
            phase="unadopted",
        )
        refresh_engine_pid(rt)
        assert (rt.proxy_host, rt.proxy_port) == ("127.0.0.1", port)

        # It closes with its shard.
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=20) == 0
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        ex = read_exit(w.dir)
        assert ex is not None and ex.stopped
    finally:
        w.cleanup()


def test_a_front_door_port_taken_fails_the_launch_before_the_engine_starts(
    tmp_path: Path,
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        w, _ = _front_door(tmp_path, squatter.getsockname()[1])
        try:
            assert w.proc.wait(timeout=20) == EXIT_LAUNCH_FAILED
            ex = read_exit(w.dir)
            assert ex is not None and "front door cannot listen" in ex.error
            assert not (w.dir / "logs" / "engine.log").exists()
        finally:
            w.cleanup()
