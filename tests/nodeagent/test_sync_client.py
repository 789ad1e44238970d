"""The sync loop's timing and the client's TLS rule (pure parts; the loop itself runs end to end
in test_agent_e2e.py)."""

from __future__ import annotations

import pytest

from llmgw.errors import ConfigError
from llmgw.nodeagent.client import check_url, is_loopback_host
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
