"""KeyCache against a real Postgres: what authenticates, how fast a revocation lands, and
that keys keep working while the database is unreachable (fail static)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.exc import DBAPIError
from structlog.testing import capture_logs

from llmgw.embedded_postgres import libpq_url
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.keys import KeyCache
from llmgw.store.credentials import parse_api_key
from llmgw.store.notify import NotifyHub
from tests.gateway.keys_testkit import insert_key, revoke_key, sessions_on
from tests.pg_harness import PgServer
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)


def _refused(cache: KeyCache, header: str | None) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        cache.authenticate(header)
    return info.value


def test_parse_takes_the_id_and_a_secret_that_may_hold_underscores() -> None:
    assert parse_api_key("Bearer llmgw_abc123_s3cr_et") == ("abc123", "s3cr_et")
    assert parse_api_key("bearer  llmgw_abc_x") == ("abc", "x")
    for bad in (None, "", "llmgw_abc_x", "Basic llmgw_a_b", "Bearer llmgwb_a_b",
                "Bearer llmgw_a", "Bearer llmgw__b", "Bearer llmgw_a_", "Bearer llmgw_a_" + "x" * 129,
                "Bearer llmgw_" + "a" * 33 + "_b"):  # fmt: skip
        assert parse_api_key(bad) is None, bad


async def test_authenticate_accepts_live_keys_only(db_url: str) -> None:
    now = [time.time()]
    async with sessions_on(db_url) as sessions:
        key_id, good = await insert_key(
            sessions, "alice", models=["m1", "lora-a"], rpm=5, tpm=100, quota=1000,
            period="day", concurrency=2, cache_salt="salt-a",
        )  # fmt: skip
        _, soon = await insert_key(
            sessions, "bob", expires_at=datetime.now(UTC) + timedelta(seconds=60)
        )
        _, gone = await insert_key(sessions, "carol")
        await revoke_key(sessions, "carol")
        cache = KeyCache(sessions=sessions, notify=None, clock=lambda: now[0])
        await cache.start()
        try:
            ctx = cache.authenticate(f"Bearer {good}")
            assert (ctx.key_id, ctx.name, ctx.allowed_models) == (
                key_id, "alice", frozenset({"m1", "lora-a"}),
            )  # fmt: skip
            assert (ctx.rpm, ctx.tpm, ctx.token_quota, ctx.quota_period, ctx.concurrency) == (
                5, 100, 1000, "day", 2,
            )  # fmt: skip
            assert ctx.cache_salt == "salt-a" and "salt-a" not in repr(ctx)
            assert ctx.allows("m1") and not ctx.allows("m2")
            assert cache.authenticate(f"Bearer {soon}").allowed_models is None

            wrong_secret = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")
            unknown_id = "llmgw_0000000000000000_" + good.split("_", 2)[2]
            for header in (None, "Bearer nope", f"Bearer {wrong_secret}",
                           f"Bearer {unknown_id}", f"Bearer {gone}", good):  # fmt: skip
                err = _refused(cache, header)
                assert (err.status, err.code) == (401, "invalid_api_key")
                assert good.split("_", 2)[2] not in err.message

            now[0] += 61  # bob's key expires: refused without any refresh
            assert _refused(cache, f"Bearer {soon}").status == 401
            assert cache.authenticate(f"Bearer {good}").name == "alice"
        finally:
            await cache.stop()


async def test_revocation_reaches_a_running_cache_within_a_second(db_url: str) -> None:
    async with sessions_on(db_url) as sessions:
        _, key = await insert_key(sessions, "tenant")
        # The periodic refresh is far away: only the NOTIFY can make this fast.
        hub = NotifyHub(libpq_url(db_url), application_name="llmgw-test-keys")
        cache = KeyCache(sessions=sessions, notify=hub, refresh_interval_s=300)
        await hub.start()
        await cache.start()
        try:
            await until(cache.listening.is_set, timeout_s=10, what="the LISTEN connection")
            assert cache.authenticate(f"Bearer {key}").name == "tenant"
            # A key created after start is usable as soon as the NOTIFY lands, too.
            _, late = await insert_key(sessions, "late")
            await until(lambda: cache.context(parse_api_key(f"Bearer {late}")[0]),  # type: ignore[index]
                        timeout_s=1, what="the new key")  # fmt: skip

            started = time.monotonic()
            await revoke_key(sessions, "tenant")

            def refused() -> bool:
                try:
                    cache.authenticate(f"Bearer {key}")
                except GatewayError:
                    return True
                return False

            await until(refused, timeout_s=1.0, what="the revocation to reach the cache")
            assert time.monotonic() - started < 1.0
        finally:
            await cache.stop()
            await hub.stop()


async def test_keys_keep_working_while_postgres_is_unreachable(
    db_url: str, pg_server: PgServer
) -> None:
    async with sessions_on(db_url) as sessions:
        _, key = await insert_key(sessions, "steady")
        _, other = await insert_key(sessions, "revoked-later")
        hub = NotifyHub(libpq_url(db_url), application_name="llmgw-test-keys")
        cache = KeyCache(sessions=sessions, notify=hub, refresh_interval_s=0.2)
        await hub.start()
        await cache.start()
        try:
            await until(cache.listening.is_set, timeout_s=10, what="the LISTEN connection")
            with capture_logs() as logs, pg_server.offline(db_url):
                await until(lambda: not cache.listening.is_set(), timeout_s=10,
                            what="the listener to drop")  # fmt: skip
                with pytest.raises(DBAPIError):  # the driver's error, as SQLAlchemy wraps it
                    await cache.refresh()
                generation = cache.generation
                await until(
                    lambda: any(e["event"] == "api_keys_refresh_failed" for e in logs),
                    timeout_s=10,
                    what="a failed periodic refresh",
                )
                # Fail static: every key loaded before the outage still authenticates.
                assert cache.authenticate(f"Bearer {key}").name == "steady"
                assert cache.authenticate(f"Bearer {other}").name == "revoked-later"
                assert cache.generation == generation
            assert key.split("_", 2)[2] not in repr(logs)
            # Back: a change made now reaches the cache (listener and refresh both recover).
            await revoke_key(sessions, "revoked-later")
            await until(lambda: cache.context(other.split("_")[1]) is None, timeout_s=15,
                        what="the cache to catch up after the outage")  # fmt: skip
            assert cache.authenticate(f"Bearer {key}").name == "steady"
        finally:
            await cache.stop()
            await hub.stop()


async def test_before_the_first_load_requests_get_503_not_401(
    db_url: str, pg_server: PgServer
) -> None:
    async with sessions_on(db_url) as sessions:
        _, key = await insert_key(sessions, "early")
        with pg_server.offline(db_url):
            hub = NotifyHub(libpq_url(db_url), application_name="llmgw-test-keys")
            cache = KeyCache(sessions=sessions, notify=hub, refresh_interval_s=60)
            with capture_logs() as logs:
                await cache.start()
            await hub.start()
            try:
                assert [e["event"] for e in logs] == ["api_keys_load_failed"]
                err = _refused(cache, f"Bearer {key}")
                assert (err.status, err.code, err.headers()) == (
                    503, "keys_unavailable", {"Retry-After": "1"},
                )  # fmt: skip
                assert _refused(cache, "Bearer junk").status == 401  # malformed: still 401
            except BaseException:
                await cache.stop()
                await hub.stop()
                raise
        try:
            await until(lambda: cache.loaded, timeout_s=15, what="the first load after the outage")
            assert cache.authenticate(f"Bearer {key}").name == "early"
        finally:
            await cache.stop()
            await hub.stop()
