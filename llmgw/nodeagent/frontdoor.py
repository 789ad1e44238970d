"""A shard's front door: its leader engine's authenticating proxy, served by the shard's own
wrapper (`llmgw shard-run`) so that it lives and dies with the engine it guards.

While the agent served every engine's proxy, an agent crash or upgrade failed every request
sent to its node until the next agent listened again (46 of 692 requests under steady load in
the fault suite, for ~2.5 s). Served by the wrapper, the proxy is untouched by the agent's
life: the agent allocates the port and hands it over with the launch, and only reads back
(procs.json) where the wrapper listens.

The proxy is ``EngineProxy`` (proxy.py) with one route, this shard: the same path allow-list,
constant-time key check before a byte of the body, body cap, streaming relay, metrics token
and listener bounds as everywhere else. It runs on an event loop of its own (uvloop where
installed) in a thread of the wrapper, rather than turning the wrapper into an asyncio
program: the wrapper's loop is a few lines of blocking, signal-driven process supervision
(``select`` on the commands' pipes, waits through a stop's grace period) that the proxy must
not stall and that must not stall the proxy; a thread keeps both as they are, and shares
nothing with the wrapper but ``start`` and ``stop``.

This module must NOT touch the shard's processes or files; the wrapper records the port.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from llmgw.logs import get_logger

__all__ = ["FrontDoor", "FrontDoorLaunch"]

_log = get_logger(__name__)
_T = TypeVar("_T")
# Binding and stopping are quick; a stop that takes longer leaves the rest to process exit.
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


class FrontDoorLaunch(BaseModel):
    """The front door's part of a shard's launch, set by the agent for a leader that serves
    HTTP (none for other ranks). Its secrets travel on stdin with the rest of the launch, never
    in a record or an argv."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The management address (agent.mgmt_addr) and the port the agent allocated from
    # agent.proxy_port_range_start..end.
    host: str
    port: int = Field(ge=1, le=65535)
    # Where the engine listens on loopback.
    upstream_port: int = Field(ge=1, le=65535)
    # An empty key would accept "Bearer " from anyone.
    api_key: str = Field(min_length=1, repr=False)
    metrics_token: str = Field(default="", repr=False)
    max_body_bytes: int = Field(default=32 << 20, gt=0)
    # agent.proxy_max_connections, agent.max_header_bytes, agent.header_timeout_s.
    max_connections: int = Field(default=4096, ge=16)
    max_header_bytes: int = Field(default=64 << 10, ge=1024)
    header_timeout_s: float = Field(default=10.0, gt=0)


class FrontDoor:
    """``EngineProxy`` for one shard on an event loop thread; ``start`` returns the bound port."""

    def __init__(self, shard_id: str, launch: FrontDoorLaunch) -> None:
        self.shard_id = shard_id
        self.launch = launch
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._proxy: Any = None

    def start(self) -> int:
        """Listen; OSError when the port cannot be bound (the shard cannot be served)."""
        # Imported here: a wrapper of a rank without a front door never loads aiohttp.
        from llmgw.http.listeners import FD_RESERVE, fit_connections
        from llmgw.nodeagent.proxy import EngineProxy, ProxyRoute, proxy_limits

        d = self.launch
        (limits,) = fit_connections(
            [
                proxy_limits(
                    max_connections=d.max_connections,
                    max_header_bytes=d.max_header_bytes,
                    header_timeout_s=d.header_timeout_s,
                )
            ],
            reserve=FD_RESERVE,
        )
        self._loop = _new_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="front-door", daemon=True
        )
        self._thread.start()
        proxy = EngineProxy(
            d.host,
            d.port,
            max_body_bytes=d.max_body_bytes,
            metrics_token=d.metrics_token,
            limits=limits,
        )
        proxy.set_routes({self.shard_id: ProxyRoute(d.upstream_port, d.api_key)})
        self._proxy = proxy
        try:
            self.port = self._call(proxy.start, _START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self.port

    def stop(self) -> None:
        """Close the listener and every connection; idempotent."""
        loop, thread, proxy = self._loop, self._thread, self._proxy
        self._loop = self._thread = self._proxy = None
        if loop is None:
            return
        if proxy is not None:
            try:
                self._call_on(loop, proxy.stop, _STOP_TIMEOUT_S)
            except (FutureTimeout, OSError, RuntimeError) as exc:
                _log.warning(
                    "front_door_stop_failed", shard=self.shard_id, error=type(exc).__name__
                )
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=_STOP_TIMEOUT_S)
        if not loop.is_running():
            loop.close()

    def _call(self, fn: Callable[[], Coroutine[Any, Any, _T]], timeout_s: float) -> _T:
        assert self._loop is not None
        return self._call_on(self._loop, fn, timeout_s)

    @staticmethod
    def _call_on(
        loop: asyncio.AbstractEventLoop,
        fn: Callable[[], Coroutine[Any, Any, _T]],
        timeout_s: float,
    ) -> _T:
        return asyncio.run_coroutine_threadsafe(fn(), loop).result(timeout=timeout_s)


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed, as every llmgw server (eventloop.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
