"""structlog, configured once per process.

JSON lines when stderr is not a terminal (production, CI, log shippers), a
readable console renderer when it is. Context (request id, shard, node) is
bound through contextvars so every line of one request or one reconcile pass
carries it without being passed around.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

__all__ = ["configure_logging", "get_logger"]


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog and the stdlib root logger (uvicorn, alembic) to match.

    ``json=None`` picks JSON unless stderr is a terminal.
    """
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error, critical")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            # The level is the stdlib logger's, checked first on every call: a reload (SIGHUP)
            # that lowers it reaches loggers already in use, which a level baked into cached
            # filtering loggers would not.
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if json else _identity,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # uvicorn installs its own handlers; route them through ours instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # The access log repeats what our request middleware logs with a request id; httpx logs
    # every control request and alembic every plugin it loads, which buries what matters.
    for noisy in ("uvicorn.access", "httpx", "httpcore", "alembic"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


def _identity(_logger: Any, _name: str, event_dict: Any) -> Any:
    return event_dict


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
