"""configure_logging: one JSON shape for our lines and other libraries', levels that a reload
changes on loggers already in use, and the stream looked up when a line is written."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from llmgw.logs import configure_logging


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
