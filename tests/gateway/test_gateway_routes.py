"""The route table against a real Postgres: which replicas are routable (ready, active, desired
running, with a proxy URL), refresh on NOTIFY, and the last table kept while Postgres is
unreachable (fail static)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from structlog.testing import capture_logs

from llmgw.embedded_postgres import libpq_url
from llmgw.gateway.routes import RouteCache
from llmgw.store.catalog import CHANGE_CHANNEL
from llmgw.store.database import create_engine, session_factory
from llmgw.store.notify import NotifyHub
from llmgw.store.routes import (
    AdapterRow,
    ObservedAdapter,
    read_adapters,
    read_declared,
    read_routes,
)
from tests.controlplane.agentapi.agentapi_testkit import place_shard
from tests.support.procs import free_port


async def _sql(sessions: async_sessionmaker[AsyncSession], sql: str, **params: Any) -> None:
    async with sessions() as session, session.begin():
        await session.execute(text(sql), params)


async def _node(sessions: async_sessionmaker[AsyncSession]) -> str:
    async with sessions() as session, session.begin():
        node = await session.execute(text("INSERT INTO nodes (name) VALUES ('n1') RETURNING id"))
        return str(node.scalar_one())


async def _ready(sessions: async_sessionmaker[AsyncSession], shard: str, **extra: str) -> None:
    await _sql(
        sessions,
        "UPDATE shards SET observed_state = 'ready', proxy_url = :url WHERE id = :id",
        id=shard,
        url=f"http://agent:9/shards/{shard}",
    )


async def test_routable_replicas_notify_and_fail_static(db_url: str) -> None:
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        node_id = await _node(sessions)
        a = await place_shard(sessions, node_id, gpus=(0,), model="alpha", kv_events=True)
        b = await place_shard(sessions, node_id, gpus=(1,), model="beta")
        await _ready(sessions, a)
        await _ready(sessions, b)
        await _sql(
            sessions,
            "UPDATE replicas SET state = 'draining' WHERE id = "
            "(SELECT replica_id FROM shards WHERE id = :id)",
            id=b,
        )
        hub = NotifyHub(libpq_url(db_url), application_name="llmgw-test-routes")
        cache = RouteCache(sessions, notify=hub, refresh_s=1.0)
        await hub.start()
        await cache.start()
        try:
            alpha, beta = cache.table.routes["alpha"], cache.table.routes["beta"]
            assert [e.shard for e in alpha.endpoints] == [a]
            params = alpha.endpoints[0].hash
            assert params is not None and (params.block_size, params.extra_key_format) == (
                16,
                "tagged",
            )
            assert alpha.endpoints[0].url == f"http://agent:9/shards/{a}"
            assert alpha.endpoints[0].api_key == "engine-key"
            # The engine process behind it, as its agent reported it: a restart changes it.
            await _sql(
                sessions,
                "UPDATE shards SET boot_id = 'boot-1', pid = 4242, process_start_time = 99 "
                "WHERE id = :id",
                id=a,
            )
            await cache.refresh()
            assert cache.table.routes["alpha"].endpoints[0].incarnation == "boot-1:4242:99"
            # The admission ceiling: the engine's default (sim: 256 + 128 waiting), then the
            # profile's live max_in_flight, read without a roll.
            assert cache.table.routes["alpha"].endpoints[0].max_in_flight == 384
            await _sql(sessions, "UPDATE profiles SET max_in_flight = 40 WHERE name = 'alpha-sim'")
            await cache.refresh()
            assert cache.table.routes["alpha"].endpoints[0].max_in_flight == 40
            # Draining: known (503), not routable.
            assert beta.endpoints == ()
            # Every shard released (scaled to zero, or replaced): still known, from the
            # deployment.
            await _sql(sessions, "UPDATE shards SET released = true WHERE id = :id", id=a)
            await cache.refresh()
            assert cache.table.routes["alpha"].endpoints == ()
            await _sql(sessions, "UPDATE shards SET released = false WHERE id = :id", id=a)
            await cache.refresh()

            # Back to active, then NOTIFY: seen well before the 1 s period.
            await _sql(
                sessions,
                "UPDATE replicas SET state = 'active' WHERE id = "
                "(SELECT replica_id FROM shards WHERE id = :id)",
                id=b,
            )
            await asyncio.wait_for(cache.listening.wait(), timeout=5)
            started = time.monotonic()
            await _sql(sessions, f"NOTIFY {CHANGE_CHANNEL}")
            # A refresh already in flight (the LISTEN connection's own, which re-reads what
            # changed while nobody listened) may end first with what it read before.
            while [e.shard for e in cache.table.routes["beta"].endpoints] != [b]:
                cache.changed.clear()
                left = started + 5 - time.monotonic()
                assert left > 0, "beta never became routable"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cache.changed.wait(), timeout=left)
            assert time.monotonic() - started < 0.8

            # Postgres unreachable: the last table stays, one warning says why. The loop stops
            # first: the trigger's NOTIFY and ours may have woken it twice, and a refresh of its
            # own still in flight would log the outage's end between the two calls below.
            await cache.stop()
            dead = create_engine(
                f"postgresql+psycopg://x:y@127.0.0.1:{free_port()}/none",
                pool_size=1,
                connect_timeout_s=1,
            )
            cache._sessions = session_factory(dead)
            with capture_logs() as logs:
                await cache._refresh_quietly()
                await cache._refresh_quietly()
            assert [e.shard for e in cache.table.routes["alpha"].endpoints] == [a]
            events = [e["event"] for e in logs]
            assert events == ["gateway_routes_refresh_failed"]
            await dead.dispose()
            cache._sessions = sessions
            with capture_logs() as logs:
                await cache._refresh_quietly()
            assert [e["event"] for e in logs] == ["gateway_routes_restored"]
        finally:
            await cache.stop()
            await hub.stop()
    finally:
        await engine.dispose()


async def test_route_changes_reach_the_gateway_through_the_database_triggers(db_url: str) -> None:
    """No writer sends a NOTIFY here and the period is a minute: the triggers of migration 0005
    are what wake the cache, for a shard turning ready, a replica draining, a shard deleted."""
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        a = await place_shard(sessions, await _node(sessions), gpus=(0,), model="gamma")
        hub = NotifyHub(libpq_url(db_url), application_name="llmgw-test-routes")
        cache = RouteCache(sessions, notify=hub, refresh_s=60.0)
        await hub.start()
        await cache.start()
        try:
            await asyncio.wait_for(cache.listening.wait(), timeout=5)

            async def after(sql: str) -> tuple[str, ...]:
                """The endpoints once the table changes after ``sql`` (within 5 s: only a
                NOTIFY can bring it that soon)."""
                before = tuple(e.shard for e in cache.table.routes["gamma"].endpoints)
                await _sql(sessions, sql, id=a)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    now = tuple(e.shard for e in cache.table.routes["gamma"].endpoints)
                    if now != before:
                        return now
                    cache.changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(cache.changed.wait(), timeout=0.5)
                raise AssertionError(f"no route change within 5 s of {sql!r}")

            assert cache.table.routes["gamma"].endpoints == ()
            ready = (
                "UPDATE shards SET observed_state = 'ready', "
                "proxy_url = 'http://agent:9/shards/' || id WHERE id = :id"
            )
            assert await after(ready) == (a,)
            draining = (
                "UPDATE replicas SET state = 'draining' "
                "WHERE id = (SELECT replica_id FROM shards WHERE id = :id)"
            )
            assert await after(draining) == ()
            active = draining.replace("'draining'", "'active'")
            assert await after(active) == (a,)
            assert await after("UPDATE shards SET observed_state = 'exited' WHERE id = :id") == ()
        finally:
            await cache.stop()
            await hub.stop()
    finally:
        await engine.dispose()


async def test_runtime_adapters_are_read_with_their_shards_and_declarations(db_url: str) -> None:
    """``store.routes`` against Postgres (issue [lora]): each shard's placed and reported
    runtime adapters (an unreadable entry skipped, not fatal), its profile's adapter slots,
    the declared adapters and each deployment's model; the cache's table from them."""
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        shard = await place_shard(sessions, await _node(sessions), gpus=(0,), model="m")
        await _ready(sessions, shard)
        await _sql(sessions, "UPDATE profiles SET adapter_slots = 3 WHERE name = 'm-sim'")
        await _sql(
            sessions,
            "INSERT INTO adapters (name, model, path) VALUES ('x', 'm', '/a/x'), ('y', 'm', '/a/y')",
        )
        desired = '[{"name": "x", "path": "/a/x", "pinned": false}, {"name": "y", "path": "/a/y"}]'
        observed = (
            '[{"name": "x", "state": "loaded", "reason": "", "failures": 0}, '
            '{"name": "y", "state": "failed", "reason": "bad adapter", "failures": 2}, '
            '"junk", {"state": "loaded"}]'
        )
        await _sql(
            sessions,
            "UPDATE shards SET desired_adapters = CAST(:d AS jsonb), "
            "observed_adapters = CAST(:o AS jsonb) WHERE id = :id",
            d=desired,
            o=observed,
            id=shard,
        )
        async with sessions() as session, session.begin():
            (row,) = await read_routes(session)
            (declared,) = await read_declared(session)
            adapters = await read_adapters(session)
        assert row.desired_adapters == {"x", "y"} and row.adapter_slots == 3
        assert row.observed_adapters == (
            ObservedAdapter("x", "loaded", ""),
            ObservedAdapter("y", "failed", "bad adapter"),
        )
        assert (declared.name, declared.model, declared.adapter_slots) == ("m", "m", 3)
        assert adapters == [AdapterRow("x", "m", "/a/x"), AdapterRow("y", "m", "/a/y")]

        cache = RouteCache(sessions, notify=None, refresh_s=60.0)
        await cache.refresh()
        x, y = cache.table.routes["x"], cache.table.routes["y"]
        assert [e.shard for e in x.endpoints] == [shard] and x.runtime
        assert dict(x.endpoints[0].adapters) == {"x": "/a/x"}
        assert y.endpoints == () and y.adapter_blocked is not None
        assert y.adapter_blocked.code == "adapter_load_failed"
        assert "bad adapter" in y.adapter_blocked.message
    finally:
        await engine.dispose()


async def test_a_lookup_that_missed_catches_up_with_one_shared_spaced_read(db_url: str) -> None:
    """An adapter declared a moment ago, its NOTIFY not read yet (here: none, and a minute's
    period): ``catch_up`` returns once a read begun after it has finished, so the name is
    found; callers at once share one read, and the next such read waits out the gap."""
    engine = create_engine(db_url, pool_size=2)
    sessions = session_factory(engine)

    class Counting(RouteCache):
        reads = 0

        async def refresh(self) -> None:
            Counting.reads += 1
            await super().refresh()

    try:
        shard = await place_shard(sessions, await _node(sessions), gpus=(0,), model="m")
        await _ready(sessions, shard)
        await _sql(sessions, "UPDATE profiles SET adapter_slots = 2 WHERE name = 'm-sim'")
        cache = Counting(sessions, notify=None, refresh_s=60.0)
        await cache.start()
        try:
            assert "m" in cache.table.routes and "x" not in cache.table.routes
            await _sql(sessions, "INSERT INTO adapters (name, model, path) VALUES ('x', 'm', '/a')")
            before = Counting.reads
            await asyncio.gather(*(cache.catch_up() for _ in range(20)))
            assert "x" in cache.table.routes
            assert Counting.reads == before + 1
            began = time.monotonic()
            await cache.catch_up()
            assert Counting.reads == before + 2
            assert time.monotonic() - began >= 0.2  # the gap since the read before it
        finally:
            await cache.stop()
    finally:
        await engine.dispose()
