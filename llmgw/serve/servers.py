"""Several uvicorn servers in one process and one event loop, with one shutdown.

The control plane serves two listeners (docs/architecture.md §1): the public one (the OpenAI
API) and the internal one (admin API, agent API, health, metrics), each with
its own app, so nothing of the internal API can answer on the public address.
Both share the loop and the process's parts (``process``: the database pool, the LISTEN
connection, the KV index).

Sockets are bound here, before any server starts: a taken port is a
``ConfigError`` naming the listener and its setting, instead of uvicorn's
``sys.exit`` from inside one server while the other is already serving.
SIGTERM or SIGINT stops every server gracefully (stop accepting, let open
requests finish within ``grace_s``, run lifespan shutdown); a second SIGINT
cuts open requests. When any server stops on its own, the others are stopped
too: a control plane with half its listeners is not one. SIGHUP calls ``on_reload``
(the command's config reload) and nothing else: a reload never stops a listener.

Every listener runs under its ``ListenerLimits`` (llmgw/http/listeners.py: the head's size and
deadline, the connection cap), with the caps fitted to the descriptor limit, raised to the
hard one first, less ``fd_reserve`` for what the process holds besides (database and upstream
pools, log files).

What it must not do: install uvicorn's per-server signal handlers (each would
replace the previous one, so only the last server would hear SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp

from llmgw import eventloop
from llmgw.config import Settings
from llmgw.controlplane.reconcile.loop import Reconciler
from llmgw.errors import ConfigError
from llmgw.http.listeners import ListenerLimits, fit_connections, uvicorn_protocol
from llmgw.logs import configure_logging, get_logger

__all__ = ["ConfigReload", "Listener", "bind", "serve"]

log = get_logger("llmgw.serve.servers")


@dataclass(frozen=True, slots=True)
class Listener:
    name: str  # "public", "internal": in logs and errors
    app: ASGIApp
    host: str
    port: int
    setting: str  # the settings key of the address, named when it cannot be bound
    limits: ListenerLimits
    # Bound already (the gateway's private listener: its port must be known before its app is
    # built, to register the instance's URL); ``serve`` closes it when done. None: bound here.
    sock: socket.socket | None = None
    # SO_REUSEPORT: several gateway worker processes each bind the same public port and the
    # kernel spreads new connections across them.
    reuse_port: bool = False


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # `serve` owns the signals for all servers of the process.
        yield


# What a reload applies while serving; every other setting is read once, at start.
_LIVE = (
    "log.level",
    "controlplane.reconcile.tick_s",
    "controlplane.reconcile.sync_period_s",
    "controlplane.reconcile.node_grace_s",
    "controlplane.reconcile.drain_timeout_s",
    "controlplane.reconcile.crash_loop_restarts",
)


def _flatten(settings: Settings) -> dict[str, object]:
    out: dict[str, object] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", settings.model_dump(mode="json"))
    return out


class ConfigReload:
    """SIGHUP: re-read the settings from the sources they came from (the same ``--config``
    file, the environment the process started with, the same command-line flags) and apply
    what can change while serving: the log level and the reconcile loop's period and rules
    (tick, sync period, node grace, drain timeout, crash-loop restarts).

    A reload whose configuration is invalid (a bad value, a grace period shorter than 5 sync
    periods, a TOML syntax error) is refused as a whole: the process keeps running on what it
    has and logs why, naming the key, never a secret's value (``load_settings`` hides them).
    Changes that need a restart (addresses, the database, the admin token, body caps, which
    middleware holds from the start) are logged by key name only, and not applied.

    Log level: raising it (info -> warning) takes effect everywhere, through the stdlib root
    logger's level. Lowering it below the level the process started with (info -> debug)
    reaches only loggers not used yet: ``llmgw.logs`` caches structlog loggers with the
    start level's filter baked in.
    """

    def __init__(
        self,
        load: Callable[[], Settings],
        current: Settings,
        *,
        reconciler: Reconciler | None,
    ) -> None:
        self._load = load
        self._current = current
        self._reconciler = reconciler

    def __call__(self) -> None:
        # The one conversion create_app uses, so a reload accepts exactly what a start does.
        from llmgw.controlplane.internal_app import plan_settings

        try:
            new = self._load()
            plan = plan_settings(new.controlplane.reconcile)
        except ConfigError as exc:
            log.error("config_reload_refused", field=exc.field, error=exc.message)
            return
        old_flat, new_flat = _flatten(self._current), _flatten(new)
        changed = {
            key: {"from": old_flat.get(key), "to": new_flat[key]}
            for key in _LIVE
            if old_flat.get(key) != new_flat.get(key)
        }
        needs_restart = sorted(
            key
            for key in new_flat.keys() | old_flat.keys()
            if key not in _LIVE
            # The agent's and `llmgw up`'s sections may share the file; this process ignores them.
            and key.startswith(("log.", "controlplane.", "gateway."))
            and old_flat.get(key) != new_flat.get(key)
        )
        if "log.level" in changed:
            configure_logging(new.log.level, json=self._current.log.json_lines)
        if self._reconciler is not None:
            self._reconciler.reconfigure(
                plan_settings=plan, tick_s=new.controlplane.reconcile.tick_s
            )
        # Only live keys move to the new values: the rest stays what the process runs on, so
        # the next reload still reports them as needing a restart.
        self._current = self._current.model_copy(
            update={
                "log": self._current.log.model_copy(update={"level": new.log.level}),
                "controlplane": self._current.controlplane.model_copy(
                    update={"reconcile": new.controlplane.reconcile}
                ),
            }
        )
        log.warning(  # at warning: a reload to a quieter level must still say it happened
            "config_reloaded", changed=changed, needs_restart=needs_restart
        )


def bind(
    host: str, port: int, *, listener: str, setting: str, reuse_port: bool = False
) -> socket.socket:
    """A listening-ready socket on ``host:port``; ConfigError naming ``setting`` if it cannot be.
    ``reuse_port``: SO_REUSEPORT, so sibling worker processes can bind the same port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"{listener} listener: host {host!r} does not resolve ({exc.strerror}); set {setting} "
            "to an address of this machine",
            field=setting,
        ) from None
    family, _, proto, _, addr = infos[0]
    # The protocol must be IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted
    # connections only then, and without it every response waits out Nagle plus the
    # client's delayed ACK (~40 ms on Linux).
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"{listener} listener cannot listen on {host}:{port}: {exc.strerror}; stop what holds "
            f"the port or set {setting} to another one",
            field=setting,
        ) from None
    # Not inheritable (Python's default): each gateway worker binds its own socket, and a
    # listener inherited by an exec'd child (a tokenizer worker) would keep the port open
    # after this process dies, so clients' connections hang instead of being refused.
    return sock


async def _freeze_once_started(servers: Sequence[uvicorn.Server]) -> None:
    # uvicorn sets `started` once its app's startup (lifespan) is done; it has no event.
    while not all(srv.started for srv in servers):
        if any(srv.should_exit for srv in servers):
            return
        await asyncio.sleep(0.05)
    eventloop.freeze_heap()


async def serve(
    listeners: Sequence[Listener],
    *,
    grace_s: float,
    fd_reserve: int,
    on_reload: Callable[[], None] | None = None,
) -> None:
    """Serve every listener until SIGTERM/SIGINT or until one of them stops; SIGHUP runs
    ``on_reload`` (which must not raise: a bad config is its to log and refuse).
    ``fd_reserve``: descriptors kept apart from the listeners' connections."""
    limits = fit_connections([lst.limits for lst in listeners], reserve=fd_reserve)
    sockets = []
    try:
        for lst in listeners:
            sockets.append(
                lst.sock
                if lst.sock is not None
                else bind(
                    lst.host,
                    lst.port,
                    listener=lst.name,
                    setting=lst.setting,
                    reuse_port=lst.reuse_port,
                )
            )
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
                # The client is the TCP peer: uvicorn's default trusts X-Forwarded-For from
                # 127.0.0.1, which let a local sender name any address to the auth throttle.
                proxy_headers=False,
                timeout_graceful_shutdown=max(1, round(grace_s)),
                lifespan="auto",
                http=uvicorn_protocol(lim),
                # A burst of thousands of connects at once overflowed uvicorn's default
                # backlog (2048): the kernel reset some. The kernel caps it at somaxconn.
                backlog=max(2048, lim.max_connections),
            )
        )
        for lst, lim in zip(listeners, limits, strict=True)
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
    if on_reload is not None:
        loop.add_signal_handler(signal.SIGHUP, on_reload)
    tasks = [
        asyncio.create_task(srv.serve(sockets=[sock]), name=f"listener-{lst.name}")
        for srv, sock, lst in zip(servers, sockets, listeners, strict=True)
    ]
    for lst, sock, lim in zip(listeners, sockets, limits, strict=True):
        host, port = sock.getsockname()[:2]
        log.info(
            "listener_started",
            listener=lst.name,
            url=f"http://{_url_host(host)}:{port}",
            max_connections=lim.max_connections,
            max_header_bytes=lim.max_header_bytes,
            header_timeout_s=lim.header_timeout_s,
        )
    freeze = asyncio.create_task(_freeze_once_started(servers), name="freeze-heap")
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for srv in servers:
            srv.should_exit = True
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
    finally:
        freeze.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        for s in sockets:
            s.close()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
