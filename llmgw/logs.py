"""structlog, configured once per process.

JSON lines when stderr is not a terminal (production, CI, log shippers), a
readable console renderer when it is. Context (request id, shard, node) is
bound through contextvars so every line of one request or one reconcile pass
carries it without being passed around.

Our own lines take structlog's native path (its processors, then one write to
stderr), not the bridge through the stdlib ``logging`` module: the bridge cost
~80 µs a line against ~25 µs, and the gateway writes an access line for every
request, which made logging a tenth of its CPU (bench/gateway.py). Other
libraries' stdlib records (uvicorn, alembic, APScheduler) still go through the
root handler, rendered by the same processors, so every line has one shape.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import structlog

__all__ = ["configure_logging", "get_logger"]

# The process's current level, read on every call: a reload (SIGHUP) that lowers it reaches
# loggers already in use, which a level baked into cached filtering loggers would not.
_level = [logging.INFO]
# One list, changed in place by every configure_logging: loggers cached on first use keep a
# reference to it, so a reload that switches the renderer reaches them too.
_processors: list[Any] = []


class _LineWriter:
    """Writes each rendered line to the current ``sys.stderr`` (a redirect or a test's capture
    made after the logger was first used is honoured), with the logger's name for
    ``add_logger_name``. What structlog's ``WriteLogger`` does, minus binding the stream."""

    def __init__(self, name: str) -> None:
        self.name = name

    def msg(self, message: str) -> None:
        stream = sys.stderr
        with _write_lock:
            stream.write(message + "\n")
            stream.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


_write_lock = threading.Lock()


_METHOD_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def _filter_by_level(_logger: Any, method_name: str, event_dict: Any) -> Any:
    if _METHOD_LEVELS.get(method_name, logging.INFO) < _level[0]:
        raise structlog.DropEvent
    return event_dict


def _line_writer(*args: Any) -> _LineWriter:
    return _LineWriter(str(args[0]) if args else "")


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
    _level[0] = numeric
    _processors[:] = [
        _filter_by_level,
        *shared,
        structlog.processors.StackInfoRenderer(),
        # JSON carries a traceback as one string field; the console renderer prints it itself.
        *([structlog.processors.format_exc_info] if json else []),
        renderer,
    ]
    structlog.configure(
        processors=_processors,
        logger_factory=_line_writer,
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
