"""configure_logging: one JSON shape for our lines and other libraries', levels that a reload
changes on loggers already in use, and the stream looked up when a line is written; the
repeat limit on warnings, and log files rotated by size (`llmgw up`'s children's included)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

import llmgw.logs as llmgw_logs
from llmgw.logs import configure_logging
from llmgw.up.children import Child
from tests.support.procs import llmgw_cmd


@pytest.fixture
def production_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        structlog.reset_defaults()
        root.handlers[:] = handlers
        root.setLevel(level)


def _lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_our_lines_and_foreign_records_share_one_json_shape(
    production_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", json=True)
    log = structlog.get_logger("llmgw.test.logs")
    with structlog.contextvars.bound_contextvars(request_id="r-1"):
        log.info("ours", n=1)
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")
    logging.getLogger("uvicorn.error").warning("foreign %s", "record")
    ours, failed, foreign = _lines(capsys.readouterr().err)
    assert ours["event"] == "ours" and ours["n"] == 1 and ours["request_id"] == "r-1"
    assert ours["level"] == "info" and ours["logger"] == "llmgw.test.logs"
    assert str(ours["timestamp"]).endswith("Z")
    assert failed["level"] == "error" and "ValueError: bad" in str(failed["exception"])
    assert foreign["event"] == "foreign record" and foreign["logger"] == "uvicorn.error"
    assert set(foreign) >= {"event", "level", "logger", "timestamp"}


def test_a_reload_reaches_loggers_already_in_use(
    production_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("warning", json=True)
    log = structlog.get_logger("llmgw.test.reload")
    log.info("hidden")
    log.warning("shown")
    assert [e["event"] for e in _lines(capsys.readouterr().err)] == ["shown"]
    configure_logging("debug", json=False)  # a SIGHUP that lowers the level, console lines
    log.debug("now shown")
    err = capsys.readouterr().err
    assert "now shown" in err and not err.lstrip().startswith("{")
    with pytest.raises(ValueError, match="not one of"):
        configure_logging("loud")


def test_repeated_warnings_are_limited_then_summarised(
    production_logging: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(llmgw_logs, "_limiter", llmgw_logs._RepeatLimiter())
    monkeypatch.setattr(llmgw_logs, "_clock", lambda: now[0])
    configure_logging("info", json=True)
    log = structlog.get_logger("llmgw.test.flood")
    for _ in range(50):
        log.error("accept_failed", error="EMFILE")
        # Other libraries' records, as asyncio writes an accept error per failed accept.
        logging.getLogger("asyncio").error("socket.accept() out of system resource")
        log.info("request", status=200)  # info lines are never limited
    lines = _lines(capsys.readouterr().err)
    assert sum(e["event"] == "accept_failed" for e in lines) == 10
    assert sum(e["event"] == "socket.accept() out of system resource" for e in lines) == 10
    assert sum(e["event"] == "request" for e in lines) == 50
    now[0] += 61  # the window is over: the next line brings the count of what was dropped
    log.warning("something_else")
    lines = _lines(capsys.readouterr().err)
    summaries = {e["of_event"]: e for e in lines if e["event"] == "log_lines_suppressed"}
    assert summaries["accept_failed"]["suppressed"] == 40
    assert summaries["accept_failed"]["of_logger"] == "llmgw.test.flood"
    assert summaries["socket.accept() out of system resource"]["suppressed"] == 40
    assert lines[-1]["event"] == "something_else"
    log.error("accept_failed", error="EMFILE")  # a new window starts with a line
    assert [e["event"] for e in _lines(capsys.readouterr().err)] == ["accept_failed"]


_WRITER = """
import os, sys
from llmgw.logs import configure_logging, get_logger, log_to_file
log_to_file(sys.argv[1], max_bytes=1 << 20, backups=2)
configure_logging("info")
log = get_logger("llmgw.test.rotate")
for i in range(40_000):
    log.info("line", i=i, pad="x" * 80)
    if i % 10_000 == 0:
        os.write(2, b"written to the descriptor directly\\n")  # as a C library would
print("printed last", flush=True)
"""


@pytest.mark.e2e
def test_a_log_file_is_rotated_at_its_size_and_takes_stdout_and_stderr(tmp_path: Path) -> None:
    path = tmp_path / "proc.log"
    done = subprocess.run(
        [sys.executable, "-c", _WRITER, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""  # everything went to the file
    rotated = sorted(p.name for p in tmp_path.iterdir())
    assert rotated == ["proc.log", "proc.log.1", "proc.log.2"]  # ~5 MB written, 2 kept
    for p in tmp_path.iterdir():
        # The size is checked every MiB written: a file passes it by at most that.
        assert p.stat().st_size <= 2 << 20, (p, p.stat().st_size)
    last = path.read_text().splitlines()
    assert last[-1] == "printed last"
    assert json.loads(last[-2])["i"] == 39_999
    text = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "written to the descriptor directly" in text


@pytest.mark.e2e
def test_an_up_child_writes_its_own_log_and_rotates_it(tmp_path: Path) -> None:
    """`llmgw up` points each child's log.file at its log: a file already past the child's
    log.max_bytes is moved aside by the child itself, and its lines go to a new one."""
    log_path = tmp_path / "controlplane.log"
    log_path.write_bytes(b"old line\n" * ((1 << 20) // 9 + 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["LLMGW_LOG__MAX_BYTES"] = str(1 << 20)
    # No database: the control plane stops at once, saying so, into its log.
    child = Child("controlplane", llmgw_cmd("controlplane"), env, log_path, stop_timeout_s=10)
    child.start()
    assert child.popen is not None
    assert child.popen.wait(timeout=60) == 2
    assert (tmp_path / "controlplane.log.1").read_text().startswith("old line")
    assert "LLMGW_CONTROLPLANE__DATABASE_URL" in log_path.read_text()
    assert "old line" not in log_path.read_text()
