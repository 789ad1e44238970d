"""Several uvicorn servers in one process and one event loop, with one shutdown.

The control plane serves two listeners (design §1): the public one (the OpenAI
API) and the internal one (admin API, agent API, health, metrics), each with
its own app, so nothing of the internal API can answer on the public address.
Both share the loop, the database pool and, later, the gateway's caches.

Sockets are bound here, before any server starts: a taken port is a
``ConfigError`` naming the listener and its setting, instead of uvicorn's
``sys.exit`` from inside one server while the other is already serving.
SIGTERM or SIGINT stops every server gracefully (stop accepting, let open
requests finish within ``grace_s``, run lifespan shutdown); a second SIGINT
cuts open requests. When any server stops on its own, the others are stopped
too: a control plane with half its listeners is not one.

What it must not do: install uvicorn's per-server signal handlers (each would
replace the previous one, so only the last server would hear SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp

from llmgw.errors import ConfigError
from llmgw.logs import get_logger

__all__ = ["Listener", "bind", "serve"]

log = get_logger("llmgw.controlplane.server")


@dataclass(frozen=True, slots=True)
class Listener:
    name: str  # "public", "internal": in logs and errors
    app: ASGIApp
    host: str
    port: int
    setting: str  # the settings key of the address, named when it cannot be bound


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # `serve` owns the signals for all servers of the process.
        yield


def bind(host: str, port: int, *, listener: str, setting: str) -> socket.socket:
    """A listening-ready socket on ``host:port``; ConfigError naming ``setting`` if it cannot be."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"{listener} listener: host {host!r} does not resolve ({exc.strerror}); set {setting} "
            "to an address of this machine",
            field=setting,
        ) from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"{listener} listener cannot listen on {host}:{port}: {exc.strerror}; stop what holds "
            f"the port or set {setting} to another one",
            field=setting,
        ) from None
    sock.set_inheritable(True)
    return sock


async def serve(listeners: Sequence[Listener], *, grace_s: float) -> None:
    """Serve every listener until SIGTERM/SIGINT or until one of them stops."""
    sockets = []
    try:
        for lst in listeners:
            sockets.append(bind(lst.host, lst.port, listener=lst.name, setting=lst.setting))
    except BaseException:
        for s in sockets:
            s.close()
        raise
    servers = [
        _Server(
            uvicorn.Config(
                lst.app,
                log_config=None,
                access_log=False,  # RequestLog writes one line per request, with its id
                timeout_graceful_shutdown=max(1, round(grace_s)),
                lifespan="auto",
            )
        )
        for lst in listeners
    ]
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        log.info("controlplane_stopping", signal=sig.name)
        for srv in servers:
            if srv.should_exit and sig == signal.SIGINT:
                srv.force_exit = True  # a second Ctrl-C: do not wait for open requests
            srv.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    tasks = [
        asyncio.create_task(srv.serve(sockets=[sock]), name=f"listener-{lst.name}")
        for srv, sock, lst in zip(servers, sockets, listeners, strict=True)
    ]
    for lst, sock in zip(listeners, sockets, strict=True):
        host, port = sock.getsockname()[:2]
        log.info("listener_started", listener=lst.name, url=f"http://{_url_host(host)}:{port}")
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for srv in servers:
            srv.should_exit = True
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        for s in sockets:
            s.close()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
