"""Runs the simulator: builds the engine and its ASGI app and serves it with uvicorn.

uvicorn is started with ``loop="auto"``, so uvloop is used when installed, and with the
httptools protocol under the listener bounds every llmgw listener has (llmgw/http/listeners.py:
the head's size and deadline, the connection cap fitted to the descriptor limit). httptools
measured 29-34 instead of 37 us of CPU per streamed token with 256 streams against h11.
SIGTERM is uvicorn's: it stops accepting, lets open responses finish, then the lifespan stops
the engine.

Must NOT parse flags or read the environment (commands/simengine.py does).
"""

from __future__ import annotations

import uvicorn

from llmgw.http.listeners import FD_RESERVE, ListenerLimits, fit_connections, uvicorn_protocol
from llmgw.logs import get_logger
from llmgw.simengine.config import SimEngineConfig
from llmgw.simengine.engine import SimEngine
from llmgw.simengine.http_app import build_app

__all__ = ["serve"]

_log = get_logger(__name__)


def serve(config: SimEngineConfig, *, limits: ListenerLimits, log_level: str = "info") -> None:
    engine = SimEngine(config)
    app = build_app(engine)
    (limits,) = fit_connections([limits], reserve=FD_RESERVE)
    _log.info(
        "simengine_starting",
        host=config.host,
        port=config.port,
        model=config.served_model_name,
        num_blocks=config.scheduler.num_blocks,
        block_size=config.scheduler.block_size,
        kv_events=config.kv_events.enabled,
        max_connections=limits.max_connections,
    )
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        log_level=log_level,
        access_log=False,
        http=uvicorn_protocol(limits),
        loop="auto",
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
