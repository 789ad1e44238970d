"""The process's one LISTEN connection (llmgw.store.notify) against a real Postgres: it fans
each channel's notifications out to exactly the subscribers of that channel over a single
connection, LISTENs a late subscription on the live connection, re-runs every on-connect
callback after an outage (logged once, recovery once), and a real `llmgw controlplane`
process holds exactly one LISTEN connection for its gateway caches and its reconciler."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from structlog.testing import capture_logs

from llmgw.embedded_postgres import libpq_url
from llmgw.store import notify
from llmgw.store.dedicated import connect_dedicated
from llmgw.store.notify import NotifyHub, Subscription
from tests.controlplane.admin.admin_testkit import running_controlplane
from tests.pg_harness import PgServer
from tests.support.waiting import until, wait_for

pytestmark = pytest.mark.timeout(60)


async def _notify(db_url: str, *channels: str) -> None:
    async with await psycopg.AsyncConnection.connect(libpq_url(db_url), autocommit=True) as conn:
        for channel in channels:
            await conn.execute(f"NOTIFY {channel}")


def _listen_connections(db_url: str) -> list[str]:
    """The application names of the sessions in ``db_url``'s database whose last statement
    was a LISTEN: the connections that hold one."""
    name = db_url.rsplit("/", 1)[1].split("?", 1)[0]
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE datname = %s "
            "AND query ILIKE 'LISTEN%%' AND pid <> pg_backend_pid()",
            (name,),
        ).fetchall()
    return sorted(str(r[0]) for r in rows)


def _leader(db_url: str) -> str:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        row = conn.execute("SELECT holder FROM leader WHERE id = 1").fetchone()
    return str(row[0]) if row else ""


class _Calls:
    """What one subscriber was called with, and an event per call for waiting."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.changed = asyncio.Event()

    def hit(self, what: str) -> None:
        self.counts[what] += 1
        self.changed.set()


async def test_one_connection_fans_each_channel_out_to_its_subscribers(db_url: str) -> None:
    hub = NotifyHub(libpq_url(db_url), application_name=f"llmgw-test-{secrets.token_hex(3)}")
    a, b, late = _Calls(), _Calls(), _Calls()
    sub_a = Subscription(["llmgw_t_one", "llmgw_t_both"], lambda: a.hit("notify"),
                         on_connect=lambda: a.hit("connect"))  # fmt: skip
    sub_b = Subscription(["llmgw_t_both"], lambda: b.hit("notify"),
                         on_connect=lambda: b.hit("connect"))  # fmt: skip
    hub.add(sub_a)
    hub.add(sub_b)
    async with hub:
        await asyncio.wait_for(hub.listening.wait(), 10)
        assert sub_a.listening.is_set() and sub_b.listening.is_set()
        assert (a.counts["connect"], b.counts["connect"]) == (1, 1)

        await _notify(db_url, "llmgw_t_one", "llmgw_t_both", "llmgw_t_nobody")
        await until(lambda: a.counts["notify"] == 2 and b.counts["notify"] == 1, timeout_s=5,
                    what="both subscribers' notifications")  # fmt: skip

        # A subscription made while connected: LISTENed on the same connection, and told so.
        sub_late = Subscription(["llmgw_t_late"], lambda: late.hit("notify"),
                                on_connect=lambda: late.hit("connect"))  # fmt: skip
        hub.add(sub_late)
        await asyncio.wait_for(sub_late.listening.wait(), 5)
        assert late.counts["connect"] == 1
        await _notify(db_url, "llmgw_t_late")
        await until(lambda: late.counts["notify"] == 1, timeout_s=5, what="the late subscriber")
        assert (a.counts["notify"], b.counts["notify"]) == (2, 1)

        # Still one connection, however many subscribers.
        assert _listen_connections(db_url) == [hub.application_name]

        # Removed: no more calls, the others go on.
        hub.remove(sub_b)
        assert not sub_b.listening.is_set()
        await _notify(db_url, "llmgw_t_both")
        await until(lambda: a.counts["notify"] == 3, timeout_s=5, what="the kept subscriber")
        assert b.counts["notify"] == 1
    assert not hub.listening.is_set()
    await until(lambda: _listen_connections(db_url) == [], timeout_s=5,
                what="the connection to close")  # fmt: skip


async def test_a_reconnect_reruns_every_on_connect_and_logs_the_outage_once(
    db_url: str, pg_server: PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = 0

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal attempts
        attempts += 1
        return await connect_dedicated(*args, **kwargs)

    monkeypatch.setattr(notify, "connect_dedicated", counted)
    hub = NotifyHub(libpq_url(db_url), application_name="llmgw-test-outage", backoff_base_s=0.05)
    one, two = _Calls(), _Calls()
    subs = [
        Subscription(["llmgw_t_one"], lambda: one.hit("notify"), on_connect=lambda: one.hit("connect")),
        Subscription(["llmgw_t_two"], lambda: two.hit("notify"), on_connect=lambda: two.hit("connect")),
    ]  # fmt: skip
    for sub in subs:
        hub.add(sub)
    async with hub:
        await asyncio.wait_for(hub.listening.wait(), 10)
        assert (one.counts["connect"], two.counts["connect"]) == (1, 1)
        with capture_logs() as logs:
            with pg_server.offline(db_url):
                await until(lambda: not hub.listening.is_set(), timeout_s=10,
                            what="the connection to drop")  # fmt: skip
                assert not any(sub.listening.is_set() for sub in subs)
                # Several failed reconnects: none of them tells an owner it is connected.
                tried = attempts
                await until(lambda: attempts >= tried + 3, timeout_s=10,
                            what="three failed reconnects")  # fmt: skip
                assert (one.counts["connect"], two.counts["connect"]) == (1, 1)
            await asyncio.wait_for(hub.listening.wait(), 10)
        # Back: every owner is told, so it re-reads what changed while nobody listened.
        assert (one.counts["connect"], two.counts["connect"]) == (2, 2)
        assert all(sub.listening.is_set() for sub in subs)
        events = [(e["log_level"], e["event"]) for e in logs]
        assert events == [("warning", "notify_listen_lost"), ("info", "notify_listen_restored")]
        await _notify(db_url, "llmgw_t_one", "llmgw_t_two")
        await until(lambda: one.counts["notify"] == 1 and two.counts["notify"] == 1,
                    timeout_s=5, what="notifications after the reconnect")  # fmt: skip


@pytest.mark.e2e
def test_a_controlplane_process_holds_one_listen_connection(
    pg_server: PgServer, _pg_template: str, tmp_path: Path
) -> None:
    """The gateway's key, route and tokenizer-file caches and the reconciler each used to open
    a LISTEN connection of their own (four per process); now they share the process's hub."""
    with running_controlplane(pg_server, _pg_template, tmp_path, reconcile=True) as cp:
        url, public, db_url = cp.url, cp.public_url, cp.db_url
        # The public listener answers once its lifespan started the gateway's caches.
        wait_for(lambda: httpx.get(f"{public}/v1/models", timeout=2).status_code == 401,
                 timeout_s=30, what="the public listener")  # fmt: skip
        # The reconciler subscribed before its first pass, which took the lead.
        wait_for(lambda: _leader(db_url), timeout_s=30, what="the reconciler to lead")
        listening = wait_for(lambda: _listen_connections(db_url), timeout_s=10, what="a LISTEN")
        assert len(listening) == 1 and listening[0].startswith("llmgw-notify-"), listening
        # The caches are served by that connection: a key made now authenticates at once
        # (the key cache's period is 30 s; only the NOTIFY through the hub can be this fast).
        made = httpx.post(
            f"{url}/admin/v1/keys", json={"name": "hub"}, headers=cp.headers, timeout=10
        )
        assert made.status_code == 201, made.text
        key = made.json()["key"]
        wait_for(
            lambda: (
                httpx.get(
                    f"{public}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2
                ).status_code
                == 200
            ),
            timeout_s=5,
            what="the new key to authenticate",
        )
        assert _listen_connections(db_url) == listening
