"""Log levels that match severity (finding 17): a shed or no-replica 503 is a capacity state
(warning), not a bug (error); an agent's routine sync is debug, while what a sync changed
keeps an info line; other 5xx stay errors.

Before: every 503 was an error-level access line, and every agent sync (one every ~2 s per
node) an info line.
"""

from __future__ import annotations

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from structlog.testing import capture_logs

from llmgw.http.errors import error_body
from llmgw.http.request_log import RequestLog
from llmgw.protocol.sync import KV_PATH, SYNC_PATH
from tests.controlplane.agentapi.agentapi_testkit import make_token, running_agent_api

pytestmark = pytest.mark.timeout(60)


def _answering(status: int) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return app


async def _level_of(status: int, path: str = "/v1/chat/completions") -> str:
    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(_message: Message) -> None:
        return None

    logged = RequestLog(
        _answering(status),
        listener="internal",
        internal_error=lambda rid: error_body("internal", rid),
        quiet_paths=(SYNC_PATH, KV_PATH),
    )
    with capture_logs() as logs:
        await logged({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)
    (line,) = [e for e in logs if e["event"] == "http_request"]
    assert line["status"] == status
    return str(line["log_level"])


async def test_a_503_is_a_warning_other_5xx_errors() -> None:
    assert await _level_of(503) == "warning"
    for status in (500, 502, 504):
        assert await _level_of(status) == "error", status
    assert await _level_of(200) == "info"
    assert await _level_of(429) == "info"


async def test_routine_agent_traffic_is_debug_but_not_its_refusals() -> None:
    assert await _level_of(200, SYNC_PATH) == "debug"
    assert await _level_of(200, KV_PATH) == "debug"
    assert await _level_of(401, SYNC_PATH) == "info"
    assert await _level_of(503, SYNC_PATH) == "warning"
    assert await _level_of(200, "/agent/v1/register") == "info"


async def test_a_sync_that_changed_something_is_an_info_line_an_unchanged_one_none(
    db_url: str,
) -> None:
    async with running_agent_api(db_url) as cp:
        node = await cp.node(await make_token(cp.sessions), "n1", gpus=2)
        with capture_logs() as first:
            await cp.sync(node, seq=1)
        changed = [e for e in first if e["event"] == "node_sync_changed"]
        assert len(changed) == 1 and changed[0]["log_level"] == "info"
        assert changed[0]["node"] == node.id
        with capture_logs() as routine:
            for seq in range(2, 6):
                assert (await cp.sync(node, seq=seq, desired_version="0")).unchanged
        assert not [e for e in routine if e["log_level"] in ("info", "warning", "error")], routine
