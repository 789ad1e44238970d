"""The gateway process (`llmgw gateway`): the public OpenAI listener apart from the control plane.

Why apart: on one event loop a flood of the public API (tokenizing, rendering, big bodies)
delays the control plane's syncs, the leader's reconcile passes and the operators' requests.
Run alone, the gateway holds its own parts, none shared in memory with the control plane:
its database engine and sessions, its LISTEN connection (``NotifyHub``: the key, route and
tokenizer-file caches hear of changes through it), its metrics registry and its KV index.

The KV index is fed exactly as a control plane's is: the process registers an instance row in
``controlplane_instances`` with the URL of its *private* listener, every control plane lists
the live rows in its sync answers, and every agent relays its KV deltas to every listed URL
(``nodeagent.kvrelay``). The private listener serves only ``/healthz``, ``/metrics`` and the
agent API's KV route, behind the same node-credential check (``agentapi.AgentApi``, whose
node table and placed-shard map it runs; register, sync and tokenizer uploads stay on the
control plane). It binds to 127.0.0.1 on a free port unless told otherwise.

``--workers N`` runs N such processes under one supervisor, each binding the public port with
SO_REUSEPORT (the kernel spreads connections across them). What the workers share, and how:
API keys, routes and tokenizer files through Postgres and its NOTIFYs (each its own caches);
quotas through Postgres (usage rows); nothing else. Each worker is its own instance with its
own KV index, so every agent relays each delta N times more (one stream per worker); per-key
rpm, tpm and concurrency and the flow control's queues are per worker (a key gets up to N times
its rpm; a model's queue bound is per worker); demand is reported per worker and summed by the
leader. A worker that dies is restarted by the supervisor after a pause.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `llmgw --help` need not load the whole server
    from prometheus_client import CollectorRegistry
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
    from starlette.types import ASGIApp

    from llmgw.config import ControlPlaneSettings
    from llmgw.kv.shard_views import ShardViews
    from llmgw.store.instances import InstanceIdentity

__all__ = ["GatewayOptions", "run_gateway"]

# A worker that dies is started again after this pause (doubling while it keeps dying).
_RESTART_PAUSE_S = 1.0
_RESTART_PAUSE_MAX_S = 30.0


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    """What `llmgw gateway` is asked for besides the settings."""

    workers: int = 1
    private_host: str = "127.0.0.1"
    # 0: a free port, chosen per worker (the instance row says which).
    private_port: int = 0
    # Where agents reach the private listener; empty: http://<private_host>:<bound port>.
    advertise_url: str = ""


def run_gateway(
    config: Path | None, overrides: dict[str, dict[str, object]], opts: GatewayOptions
) -> None:
    """Serve the public listener until SIGTERM: in this process, or in ``opts.workers``
    worker processes under this one."""
    from llmgw.errors import ConfigError

    if opts.workers > 1 and opts.private_port != 0:
        raise ConfigError(
            f"--workers {opts.workers} needs --private-port 0: each worker's private listener "
            "takes a free port of its own",
            field="--private-port",
        )
    if opts.workers > 1 and opts.advertise_url:
        raise ConfigError(
            "--advertise-url names one listener, and each worker has its own: leave it out with "
            "--workers, and set --private-host to an address agents reach",
            field="--advertise-url",
        )
    if opts.workers <= 1:
        _serve_worker(config, overrides, opts, reuse_port=False)
        return
    _supervise_workers(config, overrides, opts)


def _serve_worker(
    config: Path | None,
    overrides: dict[str, dict[str, object]],
    opts: GatewayOptions,
    *,
    reuse_port: bool,
) -> None:
    from llmgw import eventloop
    from llmgw.config import load_settings
    from llmgw.controlplane.instances import listener_url, new_instance_id
    from llmgw.controlplane.internal_app import build_parts
    from llmgw.embedded_postgres import libpq_url
    from llmgw.errors import ConfigError
    from llmgw.gateway.asgi import create_public_app
    from llmgw.http.listeners import FD_RESERVE, ListenerLimits
    from llmgw.logs import configure_logging, get_logger, log_to_file
    from llmgw.serve.process import Process, public_listener, serve_process
    from llmgw.serve.servers import ConfigReload, Listener, bind
    from llmgw.store.instances import InstanceIdentity
    from llmgw.store.notify import NotifyHub

    settings = load_settings(config, **overrides)
    if settings.log.file:
        log_to_file(
            settings.log.file, max_bytes=settings.log.max_bytes, backups=settings.log.backups
        )
    configure_logging(settings.log.level, json=settings.log.json_lines)
    cp, gw = settings.controlplane, settings.gateway
    if not cp.database_url:
        raise ConfigError(
            "controlplane.database_url is empty: the gateway reads keys and routes from the "
            "control plane's database; set LLMGW_CONTROLPLANE__DATABASE_URL",
            field="controlplane.database_url",
        )
    # Bound first: the instance row carries the port, and a taken port is a ConfigError
    # before anything else starts.
    private_sock = bind(
        opts.private_host, opts.private_port, listener="private", setting="--private-port"
    )
    try:
        port = int(private_sock.getsockname()[1])
        instance = InstanceIdentity(
            new_instance_id(gateway=True),
            opts.advertise_url.rstrip("/") or listener_url(opts.private_host, port),
        )
        notify = NotifyHub(
            libpq_url(cp.database_url), application_name=f"llmgw-notify-{instance.id}"
        )
        # No reconciler: the gateway never leads.
        parts = build_parts(cp, instance, notify=notify, reconcile=False)
    except BaseException:
        private_sock.close()
        raise
    sessions, registry, kv = parts.sessions, parts.registry, parts.kv
    public = create_public_app(
        gw, sessions=sessions, notify=notify, registry=registry, intake=kv, instance_id=instance.id
    )
    private = private_app(cp, sessions=sessions, registry=registry, instance=instance, kv=kv)
    process = Process(parts=parts, notify=notify)
    listeners = [
        public_listener(settings, public, reuse_port=reuse_port),
        Listener(
            name="private",
            app=private,
            host=opts.private_host,
            port=port,
            setting="--private-port",
            limits=ListenerLimits.of("private", cp, section="controlplane"),
            sock=private_sock,
        ),
    ]
    get_logger("llmgw.gateway").info(
        "gateway_starting",
        instance=instance.id,
        public_url=f"http://{gw.host}:{gw.port}",
        private_url=instance.internal_url,
    )
    reload = ConfigReload(lambda: load_settings(config, **overrides), settings, reconciler=None)
    fd_reserve = FD_RESERVE + 2 * cp.db_pool_size + gw.upstream_pool_size
    eventloop.run(
        serve_process(
            process, listeners, grace_s=cp.shutdown_grace_s, fd_reserve=fd_reserve, on_reload=reload
        )
    )


def private_app(
    cp: ControlPlaneSettings,
    *,
    sessions: async_sessionmaker[AsyncSession],
    registry: CollectorRegistry,
    instance: InstanceIdentity,
    kv: ShardViews,
) -> ASGIApp:
    """The gateway's private listener: liveness, its metrics, and agents' KV deltas into ``kv``
    (the agent API's KV route and credential check; the instance row is the agent API's
    heartbeat, so agents relay to this process from their next sync on)."""
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from llmgw.controlplane.admin.errors import internal_error_body
    from llmgw.controlplane.agentapi.endpoints import kv_delta
    from llmgw.controlplane.agentapi.service import AgentApi
    from llmgw.http.request_log import RequestLog
    from llmgw.protocol.kvstream import KV_PATH

    api = AgentApi(
        settings=cp.agent_api, sessions=sessions, instance=instance, registry=registry, intake=kv
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with api.running():
            yield

    app = FastAPI(title="llmgw gateway (private)", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)  # fmt: skip
    app.state.agent_api = api

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "instance": instance.id}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route(KV_PATH, kv_delta, methods=["POST"])
    return RequestLog(app, listener="private", internal_error=internal_error_body)


# --- several workers -------------------------------------------------------------------------


def _worker_main(
    config: Path | None, overrides: dict[str, dict[str, object]], opts: GatewayOptions
) -> None:
    # A supervisor killed outright must not leave workers holding the port.
    _die_with_parent()
    try:
        _serve_worker(config, overrides, opts, reuse_port=True)
    except Exception as exc:
        from llmgw.errors import ConfigError

        if isinstance(exc, ConfigError):
            print(f"error: {exc.message}", file=sys.stderr)
            sys.exit(2)
        raise


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGTERM))


def _supervise_workers(
    config: Path | None, overrides: dict[str, dict[str, object]], opts: GatewayOptions
) -> None:
    """Start ``opts.workers`` workers, restart any that dies, and stop them all on SIGTERM or
    SIGINT (forwarded as SIGTERM: each finishes its open requests)."""
    from llmgw.logs import get_logger
    from llmgw.periodic import backoff_delay

    log = get_logger("llmgw.gateway")
    # Fork, not spawn: the settings were parsed already, and nothing here runs a thread yet.
    ctx = multiprocessing.get_context("fork")
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def start() -> multiprocessing.process.BaseProcess:
        p = ctx.Process(target=_worker_main, args=(config, overrides, opts), daemon=False)
        p.start()
        log.info("gateway_worker_started", pid=p.pid)
        return p

    workers = [start() for _ in range(opts.workers)]
    exits = [0] * opts.workers
    restart_at: list[float | None] = [None] * opts.workers
    while not stopping:
        time.sleep(0.2)
        now = time.monotonic()
        for i, p in enumerate(workers):
            if p.is_alive():
                continue
            when = restart_at[i]
            if when is None:
                if p.exitcode == 2:  # a bad configuration: restarting cannot fix it
                    stopping = True
                    break
                pause = backoff_delay(exits[i], _RESTART_PAUSE_S, _RESTART_PAUSE_MAX_S)
                exits[i] += 1
                restart_at[i] = now + pause
                log.warning("gateway_worker_exited", pid=p.pid, status=p.exitcode,
                            restart_in_s=pause)  # fmt: skip
            elif now >= when:
                workers[i], restart_at[i] = start(), None
    for p in workers:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    for p in workers:
        p.join()
    if any(p.exitcode == 2 for p in workers):
        sys.exit(2)
