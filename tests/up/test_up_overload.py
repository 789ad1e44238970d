"""Overload without failure, through `llmgw up`'s demo (two simulator replicas): a burst of
6,000 concurrent streaming requests completes with [DONE] (at least 99 %), every other answer
is a 429 or 503 with Retry-After, none is a 502, and no replica is ejected: busy is not
broken. Before flow control, 3,000 such requests drew 36 % 502s and hundreds of ejections.

The burst is bounded in time (the whole test well under 90 s on two cores); the client
raises its descriptor limit and uses one aiohttp session without a connector limit.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from pathlib import Path

import aiohttp
import httpx
import pytest

from tests.up.up_harness import Up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

BURST = int(os.environ.get("LLMGW_TEST_OVERLOAD_BURST", "6000"))


def _raise_fd_limit(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


async def _one(http: aiohttp.ClientSession, url: str, key: str) -> tuple[int, bool, str | None]:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "stream": True,
    }
    try:
        async with http.post(
            f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            text = await resp.text()
            if resp.status == 200:
                return 200, "data: [DONE]" in text, None
            # Retry-After, or what the answer says where there is none.
            return resp.status, False, resp.headers.get("Retry-After") or f"none: {text[:300]}"
    except aiohttp.ClientError as exc:
        return -1, False, type(exc).__name__


async def _burst(url: str, key: str, n: int) -> list[tuple[int, bool, str | None]]:
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        return await asyncio.gather(*(_one(http, url, key) for _ in range(n)))


def test_a_burst_of_6000_streams_completes_or_is_shed_never_failed(pg_tmp_path: Path) -> None:
    _raise_fd_limit(BURST * 2 + 1024)
    up = Up.new(pg_tmp_path).start()
    try:
        info = up.wait_up()
        t0 = time.monotonic()
        results = asyncio.run(_burst(info["base_url"], info["api_key"], BURST))
        took_s = time.monotonic() - t0
        done = sum(1 for status, ok, _ in results if status == 200 and ok)
        others = [(s, ra or "none") for s, ok, ra in results if not (s == 200 and ok)]
        summary = f"{done}/{BURST} done in {took_s:.1f} s; others {sorted(others)[:10]}"
        assert done >= 0.99 * BURST, summary + up.logs()
        assert all(s in (429, 503) and not ra.startswith("none") for s, ra in others), summary
        metrics = httpx.get(f"{info['admin_url']}/metrics", timeout=10).text
        assert "llmgw_gateway_ejections_total{" not in metrics, summary
        assert 'status="502"' not in metrics, summary
        print(summary)
    finally:
        up.stop()
