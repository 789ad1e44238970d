"""The sync loop's timing and the client's TLS rule (pure parts; the loop itself runs end to end
in test_agent_e2e.py), and the same rule on the KV relay's instance URLs."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import structlog

from llmgw.errors import ConfigError
from llmgw.logs import configure_logging
from llmgw.nodeagent.client import check_url, is_loopback_host
from llmgw.nodeagent.kvrelay.relay import KvRelay
from llmgw.nodeagent.sync import SyncTiming, backoff_s


def test_backoff_grows_exponentially_to_its_cap_with_jitter() -> None:
    t = SyncTiming(interval_s=2.0, backoff_max_s=30.0, jitter=0.2)
    mid = [backoff_s(n, t, 0.5) for n in range(7)]
    assert mid == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff_s(0, t, 0.0) == pytest.approx(1.6)
    assert backoff_s(0, t, 0.999999) == pytest.approx(2.4, rel=1e-5)


@pytest.mark.parametrize(
    ("url", "insecure", "ok"),
    [
        ("http://127.0.0.1:8081", False, True),
        ("http://localhost:8081/", False, True),
        ("http://[::1]:8081", False, True),
        ("https://cp.internal:8081", False, True),
        ("http://cp.internal:8081", False, False),
        ("http://10.0.0.5:8081", False, False),
        ("http://10.0.0.5:8081", True, True),
        ("ftp://cp", True, False),
        ("cp.internal:8081", False, False),
    ],
)
def test_plain_http_only_to_loopback(url: str, insecure: bool, ok: bool) -> None:
    if ok:
        assert not check_url(url, allow_insecure_http=insecure).endswith("/")
    else:
        with pytest.raises(ConfigError, match=r"controlplane|http"):
            check_url(url, allow_insecure_http=insecure)


def test_loopback_hosts() -> None:
    assert is_loopback_host("127.0.0.2") and is_loopback_host("localhost")
    assert not is_loopback_host("10.1.1.1") and not is_loopback_host("example.com")


def test_the_kv_relay_applies_the_same_rule_to_instance_urls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The node credential goes to each control plane instance's advertised URL too: one whose
    URL the sync client would refuse gets no stream, and an error naming the fix. No shard is
    watched, so nothing is sent anywhere, the permitted instances included."""

    async def opened(allow_insecure_http: bool) -> tuple[set[str], list[dict[str, object]]]:
        relay = KvRelay(
            state_dir=tmp_path / f"relay-{allow_insecure_http}",
            auth_header=lambda: "Bearer node-credential",
            allow_insecure_http=allow_insecure_http,
        )
        await relay.start()
        try:
            for _ in range(2):  # every sync brings the list again: refused once, logged once
                relay.set_instances(
                    [
                        ("plain-remote", "http://10.0.0.7:8081"),
                        ("loopback", "http://127.0.0.1:8081/"),
                        ("tls", "https://cp-1.mgmt:8081"),
                    ]
                )
        finally:
            await relay.close()
        events = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        streams = {str(e["instance"]) for e in events if e["event"] == "kv_stream_opened"}
        return streams, [e for e in events if e["event"] == "kv_stream_refused"]

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging("info", json=True)
    try:
        streams, refused = asyncio.run(opened(False))
        assert streams == {"loopback", "tls"}
        assert len(refused) == 1 and refused[0]["instance"] == "plain-remote"
        error = str(refused[0]["error"])
        assert "controlplane.advertise_url" in error and "agent.allow_insecure_http" in error
        streams, refused = asyncio.run(opened(True))
        assert streams == {"plain-remote", "loopback", "tls"} and refused == []
    finally:
        structlog.reset_defaults()
        root.handlers[:] = handlers
        root.setLevel(level)
