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

Two bounds, so a flood of one failure cannot fill a disk (an agent out of descriptors wrote
145,918 identical "socket.accept() out of system resource" lines, 77 MB in 40 s):

- warnings and errors repeat at most ``_REPEATS_PER_WINDOW`` times per ``_REPEAT_WINDOW_S``
  per (logger, event); past that they are counted, and the first line logged after the window
  is over is preceded by one ``log_lines_suppressed`` line with the count. Info and debug
  lines are never limited: the access log writes one identical event per request;
- ``log_to_file`` (the ``log.file`` setting, which `llmgw up` sets for its children) points
  the process's stdout and stderr at a file and rotates it at a size, keeping a few old ones:
  whatever writes to the descriptors (a traceback, a C library) lands in the file too.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog

__all__ = ["configure_logging", "get_logger", "log_to_file", "rotate_file"]

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
        _write(message + "\n")

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


# One lock for every line (ours and stdlib records) and for a rotation: a line is never split
# between two files, nor interleaved with another thread's.
_write_lock = threading.Lock()


def _write(text: str) -> None:
    with _write_lock:
        stream = sys.stderr
        stream.write(text)
        stream.flush()
        sink = _sink[0]
        if sink is not None:
            sink.wrote(len(text))


class _LineHandler(logging.Handler):
    """The root handler: stdlib records, rendered by the formatter, written by ``_write``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def rotate_file(path: Path, backups: int) -> None:
    """Move ``path`` to ``path.1`` (``.1`` to ``.2`` and so on, the oldest past ``backups``
    dropped); with no backups, remove it. A missing file is no error."""
    for n in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
    try:
        if backups > 0:
            os.replace(path, path.with_name(f"{path.name}.1"))
        else:
            path.unlink()
    except FileNotFoundError:
        pass


class _FileSink:
    """The log file behind descriptors 1 and 2, rotated past ``max_bytes``."""

    # The file's real size is read (fstat) only every so many bytes of our own lines: others'
    # writes to the descriptors (tracebacks, C libraries) are counted then, at no cost per line.
    _CHECK_EVERY = 1 << 20

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._until_check = 0

    def open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        finally:
            os.close(fd)
        self._until_check = 0

    def wrote(self, n: int) -> None:
        self._until_check -= n
        if self._until_check > 0:
            return
        try:
            size = os.fstat(2).st_size
            if size >= self.max_bytes:
                rotate_file(self.path, self.backups)
                self.open()
                size = 0
        except OSError:
            # Out of descriptors or space: keep writing where we are and try again later;
            # losing the rotation once is better than losing the line or the process.
            size = 0
        self._until_check = min(self._CHECK_EVERY, max(1, self.max_bytes - size))


_sink: list[_FileSink | None] = [None]


def log_to_file(path: str | Path, *, max_bytes: int, backups: int) -> None:
    """Send this process's stdout and stderr (every log line, and whatever else writes there)
    to ``path``, appended, moved to ``path.1`` once it holds ``max_bytes`` (``backups`` old
    files kept). A file already past the size is moved aside first. Call before
    ``configure_logging``, which then sees no terminal and picks JSON."""
    sink = _FileSink(Path(path), max_bytes, backups)
    with _write_lock:
        try:
            if sink.path.stat().st_size >= max_bytes:
                rotate_file(sink.path, backups)
        except FileNotFoundError:
            pass
        sink.open()
        _sink[0] = sink


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


_REPEAT_WINDOW_S = 60.0
_REPEATS_PER_WINDOW = 10
# Distinct keys tracked at most: stdlib messages may carry varying text (addresses).
_MAX_KEYS = 1024
_SUPPRESSED_EVENT = "log_lines_suppressed"


class _RepeatLimiter:
    """Per (logger, event): how many lines this window, and how many were dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # key -> [window start, lines logged, lines dropped]
        self._windows: dict[tuple[str, str], list[float]] = {}
        self._next_due = float("inf")

    def allow(self, key: tuple[str, str] | None, now: float) -> tuple[bool, list[Any]]:
        """Whether a line of ``key`` (None: one never limited) may be written, and the
        summaries of windows over by ``now`` that dropped lines."""
        with self._lock:
            due = self._due(now) if now >= self._next_due else []
            if key is None:
                return True, due
            window = self._windows.get(key)
            if window is None or now - window[0] >= _REPEAT_WINDOW_S:
                if len(self._windows) >= _MAX_KEYS:
                    self._windows.clear()  # a flood of distinct texts: start over, stay bounded
                self._windows[key] = [now, 1.0, 0.0]
                return True, due
            if window[1] < _REPEATS_PER_WINDOW:
                window[1] += 1
                return True, due
            window[2] += 1
            self._next_due = min(self._next_due, window[0] + _REPEAT_WINDOW_S)
            return False, due

    def _due(self, now: float) -> list[Any]:
        out = []
        next_due = float("inf")
        for key, (start, _, dropped) in list(self._windows.items()):
            if not dropped:
                continue
            if now - start >= _REPEAT_WINDOW_S:
                out.append((key, int(dropped)))
                del self._windows[key]
            else:
                next_due = min(next_due, start + _REPEAT_WINDOW_S)
        self._next_due = next_due
        return out


_limiter = _RepeatLimiter()
_clock = time.monotonic  # the limiter's clock (tests step it)


def _report_suppressed(due: list[Any]) -> None:
    for (logger_name, event), dropped in due:
        get_logger("llmgw.logs").warning(
            _SUPPRESSED_EVENT,
            of_logger=logger_name,
            of_event=event,
            suppressed=dropped,
            window_s=_REPEAT_WINDOW_S,
        )


def _limit_repeats(logger: Any, method_name: str, event_dict: Any) -> Any:
    key = None
    if _METHOD_LEVELS.get(method_name, logging.INFO) >= logging.WARNING:
        event = str(event_dict.get("event", ""))
        if event != _SUPPRESSED_EVENT:
            key = (str(getattr(logger, "name", "")), event)
    allowed, due = _limiter.allow(key, _clock())
    if due:
        _report_suppressed(due)
    if not allowed:
        raise structlog.DropEvent
    return event_dict


class _RepeatFilter(logging.Filter):
    """The same limit for other libraries' records (asyncio's accept errors, uvicorn's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        key = None
        if record.levelno >= logging.WARNING:
            key = (record.name, str(record.msg)[:200])
        allowed, due = _limiter.allow(key, _clock())
        if due:
            _report_suppressed(due)
        return allowed


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
        # No locals in a traceback: a frame's locals can hold a token or a request's headers.
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(),
            exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False),
        )
    )
    _level[0] = numeric
    _processors[:] = [
        _filter_by_level,
        _limit_repeats,
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
    handler = _LineHandler()
    handler.setFormatter(formatter)
    handler.addFilter(_RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # uvicorn installs its own handlers; route them through ours instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # The access log repeats what our request middleware logs with a request id; httpx logs
    # every control request and alembic every plugin it loads, which buries what matters;
    # APScheduler two lines per run of every periodic job (its warnings still show).
    for noisy in ("uvicorn.access", "httpx", "httpcore", "alembic", "apscheduler"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


def _identity(_logger: Any, _name: str, event_dict: Any) -> Any:
    return event_dict


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
