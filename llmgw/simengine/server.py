"""Runs the simulator: builds the engine and its ASGI app and serves it with uvicorn.

uvicorn is started with `http="auto"` and `loop="auto"`, so httptools and
uvloop are used when installed (measured: 29-34 instead of 37 us of CPU per
streamed token with 256 streams) and h11/asyncio otherwise. SIGTERM is uvicorn's: it stops accepting,
lets open responses finish, then the lifespan stops the engine.

Must NOT parse flags or read the environment (commands/simengine.py does).
"""

from __future__ import annotations

import uvicorn

from llmgw.logs import get_logger
from llmgw.simengine.config import SimEngineConfig
from llmgw.simengine.engine import SimEngine
from llmgw.simengine.http_app import build_app

__all__ = ["serve"]

_log = get_logger(__name__)


def serve(config: SimEngineConfig, *, log_level: str = "info") -> None:
    engine = SimEngine(config)
    app = build_app(engine)
    _log.info(
        "simengine_starting",
        host=config.host,
        port=config.port,
        model=config.served_model_name,
        num_blocks=config.scheduler.num_blocks,
        block_size=config.scheduler.block_size,
        kv_events=config.kv_events.enabled,
    )
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        log_level=log_level,
        access_log=False,
        http="auto",
        loop="auto",
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
