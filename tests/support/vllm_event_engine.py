"""An engine process whose KV events come from vLLM's own ``ZmqEventPublisher``.

The node agent starts it as it starts `vllm serve` (it is the adapter's configured path, behind
a small wrapper that adds ``--vllm-source``), with the flags llmgw's vLLM adapter emits. From
those it takes ``--host``/``--port`` (its HTTP API) and ``--kv-events-config``, which it parses
as vLLM parses it (``TypeAdapter(KVEventsConfig).validate_json``: vLLM's own config class, so an
unknown key is refused) and hands to vLLM's ``EventPublisherFactory.create``. Everything else a
real vLLM would do (load a model, schedule, compute block hashes) is left out: the test says
which events to publish.

HTTP:
- ``GET /health`` (200, empty, as vLLM), ``GET /v1/models``, ``GET /metrics`` (empty);
- with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1`` (vLLM serves its sleep routes
  only in development mode; 404 otherwise, as vLLM): ``POST /sleep?level=N&mode=M`` (level 1
  and above drop the prefix cache, so vLLM's scheduler publishes ``AllBlocksCleared``: so
  does this), ``POST /wake_up``, ``GET /is_sleeping``, and, the test's own,
  ``GET /control_calls``: every sleep and wake call's path and query, in order;
- ``POST /publish`` ``{"batches": [{"events": [...], "lost": bool}]}``: each batch becomes one
  ``KVEventBatch`` of vLLM's own event structs, published in order; a ``lost`` batch is
  buffered for replay by vLLM as usual but never reaches the wire, as if the network (or an
  overflowing high-water mark) had lost it. Answers once every batch went through the PUB
  socket: ``{"seqs": [...], "shape": "array"|"map"}`` (the wire shape of the events, read back
  from vLLM's payload). An event is ``{"type": "BlockStored", field: value, ...}`` with
  vLLM's field names; required fields left out are sent as nil; a hash given as
  ``{"bin": "<hex>"}`` is sent as bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

The one seam into vLLM's object is its PUB socket (``_pub``), wrapped to count frames and to
lose the ``lost`` ones; a release that renames it fails here, loudly. It must NOT import llmgw:
it is the engine side, and the relay must decode what vLLM's code sends, not what ours does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import parse_qs

import msgspec
from pydantic import TypeAdapter

# Run as a script: its own directory (tests/support) is on sys.path.
from vllm_source import load_kv_events

_SEND_TIMEOUT_S = 10.0


class LossySocket:
    """Stands in for the publisher's PUB socket: counts every frame and drops the lost ones."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.lost: set[int] = set()
        self.sent = 0
        self.shape = ""
        self.cond = threading.Condition()

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> Any:
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        result = None
        if seq not in self.lost:
            result = self._sock.send_multipart(frames, *args, **kwargs)
        events = msgspec.msgpack.decode(payload)[1]
        with self.cond:
            if events and not self.shape:
                self.shape = "array" if isinstance(events[0], list) else "map"
            self.sent += 1
            self.cond.notify_all()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class Engine:
    def __init__(self, kv: ModuleType, config_json: str) -> None:
        self.kv = kv
        config_cls = sys.modules["vllm.config.kv_events"].KVEventsConfig
        config = TypeAdapter(config_cls).validate_json(config_json)
        self.publisher = kv.EventPublisherFactory.create(config, data_parallel_rank=0)
        pub = getattr(self.publisher, "_pub", None)
        if not hasattr(pub, "send_multipart"):
            raise RuntimeError(
                f"{type(self.publisher).__name__} has no PUB socket at _pub (is "
                "enable_kv_cache_events set? did vLLM rename it? then update LossySocket)"
            )
        self.socket = LossySocket(pub)
        self.publisher._pub = self.socket
        self.published = 0
        self.lock = threading.Lock()  # one /publish at a time: seqs are assigned in order
        self.sleeping = False
        self.control_calls: list[str] = []

    def publish(self, batches: list[dict[str, Any]]) -> dict[str, Any]:
        with self.lock:
            seqs = []
            for batch in batches:
                seq = self.published
                if batch.get("lost"):
                    self.socket.lost.add(seq)
                events = [self._event(e) for e in batch["events"]]
                self.publisher.publish(self.kv.KVEventBatch(ts=time.time(), events=events))
                self.published += 1
                seqs.append(seq)
            deadline = time.monotonic() + _SEND_TIMEOUT_S
            with self.socket.cond:
                while self.socket.sent < self.published:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{self.published - self.socket.sent} batches unsent")
                    self.socket.cond.wait(left)
            return {"seqs": seqs, "shape": self.socket.shape}

    def _event(self, spec: dict[str, Any]) -> Any:
        cls = getattr(self.kv, spec["type"])
        kwargs: dict[str, Any] = {}
        for f in msgspec.structs.fields(cls):
            if f.name in spec:
                kwargs[f.name] = _hashes(spec[f.name]) if "hash" in f.name else spec[f.name]
            elif f.required:
                kwargs[f.name] = None
        return cls(**kwargs)


def _hashes(value: Any) -> Any:
    if isinstance(value, list):
        return [_hashes(v) for v in value]
    if isinstance(value, dict):
        return bytes.fromhex(value["bin"])
    return value


def _handler(engine: Engine, served_name: str, sleep_routes: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass  # the agent's health checks would fill the log

        def _answer(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, b"")
            elif self.path == "/v1/models":
                self._answer(200, json.dumps({"data": [{"id": served_name}]}).encode())
            elif self.path == "/metrics":
                self._answer(200, b"", "text/plain")
            elif sleep_routes and self.path == "/is_sleeping":
                self._answer(200, json.dumps({"is_sleeping": engine.sleeping}).encode())
            elif sleep_routes and self.path == "/control_calls":
                self._answer(200, json.dumps(engine.control_calls).encode())
            else:
                self._answer(404, b"{}")

        def do_POST(self) -> None:
            route, _, query = self.path.partition("?")
            if sleep_routes and route in ("/sleep", "/wake_up"):
                engine.control_calls.append(self.path)
                if route == "/sleep":
                    level = int(parse_qs(query).get("level", ["1"])[0])
                    if level >= 1:
                        engine.publish([{"events": [{"type": "AllBlocksCleared"}]}])
                engine.sleeping = route == "/sleep"
                self._answer(200, json.dumps({"sleeping": engine.sleeping}).encode())
                return
            if self.path != "/publish":
                self._answer(404, b"{}")
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._answer(200, json.dumps(engine.publish(body["batches"])).encode())

    return Handler


def _stop(_signum: int, _frame: Any) -> None:
    # The supervisor's SIGTERM: leave serve_forever, then shut the publisher down as vLLM does.
    raise KeyboardInterrupt


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-source", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kv-events-config", required=True)
    parser.add_argument("--served-model-name", default="model")
    parser.add_argument("--enable-sleep-mode", action="store_true")
    args, _vllm_flags = parser.parse_known_args(argv)
    engine = Engine(load_kv_events(args.vllm_source), args.kv_events_config)
    sleep_routes = args.enable_sleep_mode and os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    handler = _handler(engine, args.served_model_name, sleep_routes)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.publisher.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
