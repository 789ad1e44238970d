"""A small, real HTTP server of the agent protocol (llmgw.protocol), for the agent's tests.

Stands in for the control plane's agent API until that exists: in memory,
served by uvicorn on 127.0.0.1 from a thread of the test process, so a test
sets the desired set per node, reads the bindings the agent reported,
revokes a credential, approves a pending node, changes the cluster id, or
takes the server down and brings it back on the same port. It authenticates
before reading a body and caps what it reads, like the real one must.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from llmgw.protocol import (
    REGISTER_PATH,
    SYNC_PATH,
    ControlPlaneInstance,
    DesiredShard,
    RegisterRequest,
    RegisterResponse,
    ShardBinding,
    SyncRequest,
    SyncResponse,
)
from tests.support.waiting import wait_for

__all__ = ["NodeEntry", "ProtocolServer", "protocol_server"]

_MAX_BODY = 8 << 20


@dataclass
class NodeEntry:
    node_id: str
    name: str
    credential: str
    approved: bool
    desired: list[DesiredShard] = field(default_factory=list)
    desired_version: int = 1
    confirmed_drain: bool = False
    bindings: dict[str, ShardBinding] = field(default_factory=dict)
    epoch_seq: tuple[int, int] = (-1, -1)
    syncs: int = 0
    inventory: Any = None
    inventories_received: int = 0
    last_request: SyncRequest | None = None
    # Every sync request, in arrival order.
    history: list[SyncRequest] = field(default_factory=list)


class ProtocolServer:
    def __init__(self, *, port: int, bootstrap_token: str = "boot-token-0123456789") -> None:
        self.port = port
        self.bootstrap_token = bootstrap_token
        self.cluster_id = "cluster-a"
        self.instance_id = "cp-test-1"
        self.require_approval = False
        self.nodes: dict[str, NodeEntry] = {}
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # --- test controls --------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def node(self, name: str) -> NodeEntry:
        with self._lock:
            for n in self.nodes.values():
                if n.name == name:
                    return n
        raise KeyError(name)

    def set_desired(
        self, name: str, shards: Sequence[DesiredShard], *, confirmed_drain: bool = False
    ) -> None:
        n = self.node(name)
        with self._lock:
            n.desired = list(shards)
            n.desired_version += 1
            n.confirmed_drain = confirmed_drain

    def bindings(self, name: str) -> dict[str, ShardBinding]:
        n = self.node(name)
        with self._lock:
            return dict(n.bindings)

    def history(self, name: str) -> list[SyncRequest]:
        n = self.node(name)
        with self._lock:
            return list(n.history)

    def revoke(self, name: str) -> None:
        n = self.node(name)
        with self._lock:
            n.credential = "revoked-" + secrets.token_hex(8)

    def approve(self, name: str) -> None:
        n = self.node(name)
        with self._lock:
            n.approved = True

    # --- serving --------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        async def body(request: Request) -> bytes:
            chunks = []
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > _MAX_BODY:
                    raise ValueError("body too large")
                chunks.append(chunk)
            return b"".join(chunks)

        def error(status: int, code: str, message: str) -> Response:
            return JSONResponse({"code": code, "message": message}, status_code=status)

        @app.post(REGISTER_PATH)
        async def register(request: Request) -> Response:
            try:
                req = RegisterRequest.model_validate_json(await body(request))
            except (ValidationError, ValueError):
                return error(400, "bad-request", "invalid register body")
            if not secrets.compare_digest(req.bootstrap_token, self.bootstrap_token):
                return error(401, "unauthorized", "bootstrap token is not valid")
            with self._lock:
                existing = next((n for n in self.nodes.values() if n.name == req.node_name), None)
                if existing is not None:
                    entry = existing
                    entry.credential = secrets.token_urlsafe(24)
                else:
                    entry = NodeEntry(
                        node_id=f"node-{len(self.nodes) + 1}",
                        name=req.node_name,
                        credential=secrets.token_urlsafe(24),
                        approved=not self.require_approval,
                    )
                    self.nodes[entry.node_id] = entry
                entry.inventory = req.inventory
                resp = RegisterResponse(
                    node_id=entry.node_id,
                    node_credential=entry.credential,
                    cluster_id=self.cluster_id,
                    approval_state="approved" if entry.approved else "pending",
                )
            return Response(resp.model_dump_json(), media_type="application/json")

        @app.post(SYNC_PATH)
        async def sync(request: Request) -> Response:
            auth = request.headers.get("authorization", "")
            token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
            with self._lock:
                entry = next(
                    (
                        n
                        for n in self.nodes.values()
                        if token and secrets.compare_digest(n.credential, token)
                    ),
                    None,
                )
            # Authenticate before reading the body.
            if entry is None:
                return error(401, "unauthorized", "node credential is not valid")
            try:
                req = SyncRequest.model_validate_json(await body(request))
            except (ValidationError, ValueError):
                return error(400, "bad-request", "invalid sync body")
            if req.node_id != entry.node_id:
                return error(409, "conflict", "node id is not the credential's")
            with self._lock:
                entry.syncs += 1
                entry.last_request = req
                entry.history.append(req)
                if req.inventory is not None:
                    entry.inventory = req.inventory
                    entry.inventories_received += 1
                if (req.agent_epoch, req.seq) > entry.epoch_seq:
                    entry.epoch_seq = (req.agent_epoch, req.seq)
                    entry.bindings = {b.shard_id: b for b in req.bindings}
                version = str(entry.desired_version)
                instances = (ControlPlaneInstance(id=self.instance_id, internal_url=self.url),)
                if not entry.approved:
                    resp = SyncResponse(
                        cluster_id=self.cluster_id,
                        instance_id=self.instance_id,
                        instances=instances,
                        approval_state="pending",
                    )
                elif req.desired_version == version:
                    resp = SyncResponse(
                        cluster_id=self.cluster_id,
                        instance_id=self.instance_id,
                        instances=instances,
                        desired_version=version,
                        unchanged=True,
                    )
                else:
                    resp = SyncResponse(
                        cluster_id=self.cluster_id,
                        instance_id=self.instance_id,
                        instances=instances,
                        desired_version=version,
                        shards=tuple(entry.desired),
                        confirmed_drain=entry.confirmed_drain,
                    )
            return Response(resp.model_dump_json(), media_type="application/json")

        return app

    def up(self) -> None:
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_config=None,
            access_log=False,
            lifespan="off",
        )
        server = uvicorn.Server(config)
        # Signal handlers belong to the test process, not to this server.
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
        thread.start()

        def started() -> bool:
            assert thread.is_alive(), f"protocol test server's thread ended (port {self.port})"
            return bool(server.started)

        what = f"the protocol test server to start on port {self.port}"
        wait_for(started, timeout_s=10, what=what, interval_s=0.01)
        self._server, self._thread = server, thread

    def down(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._server = self._thread = None


@contextmanager
def protocol_server(port: int) -> Iterator[ProtocolServer]:
    server = ProtocolServer(port=port)
    server.up()
    try:
        yield server
    finally:
        server.down()
