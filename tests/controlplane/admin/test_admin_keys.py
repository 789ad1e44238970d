"""API keys and usage through the admin API and the CLI, over real HTTP against a real
`llmgw controlplane` and Postgres: the lifecycle, the secret shown once and nowhere else,
revocation reaching a running gateway's KeyCache within a second, and usage reads."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from llmgw.commands.keys import parse_time
from llmgw.embedded_postgres import libpq_url as libpq
from llmgw.errors import SpecError
from llmgw.gateway.accounting import UsageRecorder
from llmgw.gateway.errors import GatewayError
from llmgw.gateway.keys import KeyCache
from llmgw.store.database import create_engine, session_factory
from llmgw.store.notify import NotifyHub
from tests.controlplane.admin.admin_testkit import ControlPlane, count, name, run_cli, sql

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def aclient(cp: ControlPlane) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=f"{cp.url}/admin/v1", headers=cp.headers, timeout=10
    ) as c:
        yield c


def _ok(r: httpx.Response, status: int = 200) -> Any:
    assert r.status_code == status, r.text
    return r.json() if r.content else None


def _refused(r: httpx.Response, status: int, field: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    return str(err["message"])


def _audit(cp: ControlPlane, key_name: str) -> list[tuple[str, str]]:
    rows = sql(
        cp.db_url,
        "SELECT action, coalesce(before::text, '') || coalesce(after::text, '') FROM audit_log "
        "WHERE object_kind = 'key' AND object_name = %s ORDER BY id",
        (key_name,),
    )
    return [(r[0], r[1]) for r in rows]


@pytest.mark.e2e
def test_key_lifecycle_shows_the_secret_once(client: httpx.Client, cp: ControlPlane) -> None:
    key_name = name("team")
    expires = (datetime.now(UTC) + timedelta(days=30)).isoformat()
    created = _ok(
        client.post(
            "/keys",
            json={"name": key_name, "models": ["m2", "m1", "m1"], "rpm": 60, "tpm": 10_000,
                  "quota": 1_000_000, "period": "day", "concurrency": 4, "expires_at": expires,
                  "cache_salt": True},
        ),
        201,
    )  # fmt: skip
    key, key_id = created["key"], created["id"]
    assert key.startswith(f"llmgw_{key_id}_") and len(key.split("_", 2)[2]) >= 43
    secret = key[len(f"llmgw_{key_id}_") :]
    assert (created["allowed_models"], created["rate_limit_rpm"], created["rate_limit_tpm"],
            created["token_quota"], created["quota_period"], created["concurrency_limit"],
            created["cache_salted"], created["disabled"]) == (
        ["m1", "m2"], 60, 10_000, 1_000_000, "day", 4, True, False,
    )  # fmt: skip
    stored = sql(cp.db_url, "SELECT secret_sha256, cache_salt FROM api_keys WHERE id = %s",
                 (key_id,))[0]  # fmt: skip
    digest, salt = bytes(stored[0]).hex(), stored[1]
    assert salt and len(salt) >= 16

    one = client.get(f"/keys/{key_name}")
    listing = client.get("/keys", params={"limit": 1000})
    assert _ok(one)["id"] == key_id and "key" not in one.json()
    assert key_name in [k["name"] for k in _ok(listing)["items"]]
    audit = _audit(cp, key_name)
    for text in (one.text, listing.text, " ".join(a for _, a in audit), cp.log.read_text()):
        assert secret not in text and digest not in text and salt not in text

    # Revoke: the row stays (accounting), disabled; again writes nothing; DELETE is the same.
    assert _ok(client.post(f"/keys/{key_name}/revoke"))["disabled"] is True
    assert _ok(client.post(f"/keys/{key_name}/revoke"))["disabled"] is True
    _ok(client.delete(f"/keys/{key_name}"), 204)
    assert _ok(client.get(f"/keys/{key_name}"))["disabled"] is True
    assert [a for a, _ in _audit(cp, key_name)] == ["create", "revoke"]

    other = name("plain")
    plain = _ok(client.post("/keys", json={"name": other, "quota": 5}), 201)
    assert (plain["allowed_models"], plain["quota_period"], plain["cache_salted"]) == (
        None, "month", False,
    )  # fmt: skip
    _ok(client.delete(f"/keys/{other}"), 204)
    assert _ok(client.get(f"/keys/{other}"))["disabled"] is True
    _refused(client.get("/keys/nope"), 404, "name")
    _refused(client.post("/keys/nope/revoke"), 404, "name")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "a/b"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "x", "rpm": 0}, "rpm"),
        ({"name": "x", "tpm": -1}, "tpm"),
        ({"name": "x", "concurrency": 2**31}, "concurrency"),
        ({"name": "x", "quota": 5, "period": "week"}, "period"),
        ({"name": "x", "models": ["../etc"]}, "models.0"),
        ({"name": "x", "cache_salt": ""}, "cache_salt"),
        ({"name": "x", "cache_salt": 1}, "cache_salt"),
        ({"name": "x", "expires_at": "2020-01-01T00:00:00+00:00"}, "expires_at"),
        ({"name": "x", "expires_at": "2099-01-01T00:00:00"}, "expires_at"),  # no offset
        ({"name": "x", "secret": "mine"}, "secret"),
    ],
)
@pytest.mark.e2e
def test_key_bodies_that_break_a_rule_are_refused(
    client: httpx.Client, cp: ControlPlane, body: dict[str, Any], field: str
) -> None:
    before = count(cp.db_url, "api_keys")
    r = client.post("/keys", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == field, r.text
    assert count(cp.db_url, "api_keys") == before


@pytest.mark.e2e
def test_a_period_needs_a_quota_and_names_are_unique(client: httpx.Client) -> None:
    message = _refused(client.post("/keys", json={"name": "x", "period": "day"}), 422, None)
    assert "period without a quota" in message
    key_name = name("dup")
    _ok(client.post("/keys", json={"name": key_name}), 201)
    _ok(client.post(f"/keys/{key_name}/revoke"))
    assert "exists already" in _refused(client.post("/keys", json={"name": key_name}), 409, "name")


@pytest.mark.e2e
def test_keys_and_usage_need_the_admin_token(cp: ControlPlane) -> None:
    with httpx.Client(base_url=f"{cp.url}/admin/v1", timeout=10) as anon:
        for method, path in (("POST", "/keys"), ("GET", "/keys"), ("GET", "/keys/x"),
                             ("POST", "/keys/x/revoke"), ("DELETE", "/keys/x"),
                             ("GET", "/usage")):  # fmt: skip
            assert anon.request(method, path, json={"name": "x"}).status_code == 401, path


@pytest.mark.e2e
async def test_revocation_through_the_api_reaches_a_running_gateway_within_a_second(
    aclient: httpx.AsyncClient, cp: ControlPlane
) -> None:
    key_name = name("live")
    key = _ok(await aclient.post("/keys", json={"name": key_name}), 201)["key"]
    secret = key.split("_", 2)[2]
    engine = create_engine(cp.db_url, pool_size=2)
    hub = NotifyHub(libpq(cp.db_url), application_name="llmgw-test-keys")
    cache = KeyCache(sessions=session_factory(engine), notify=hub, refresh_interval_s=300)
    try:
        with capture_logs() as logs:
            await hub.start()
            await cache.start()
            deadline = time.monotonic() + 10
            while not cache.listening.is_set() and time.monotonic() < deadline:
                await _sleep()
            assert cache.authenticate(f"Bearer {key}").name == key_name
            for wrong in (key[:-1], key + "x", "Bearer " + key.replace("llmgw_", "llmgwb_")):
                with pytest.raises(GatewayError):
                    cache.authenticate(f"Bearer {wrong}")
            started = time.monotonic()
            _ok(await aclient.post(f"/keys/{key_name}/revoke"))  # returns after the commit
            while time.monotonic() - started < 1.0:
                try:
                    cache.authenticate(f"Bearer {key}")
                except GatewayError as exc:
                    assert exc.status == 401
                    break
                await _sleep()
            else:
                pytest.fail("the revoked key still authenticates 1 s after the revoke")
        assert secret not in repr(logs)
    finally:
        await cache.stop()
        await hub.stop()
        await engine.dispose()


async def _sleep() -> None:
    await asyncio.sleep(0.01)


async def _record_usage(cp: ControlPlane, key_id: str, minute: datetime) -> None:
    engine = create_engine(cp.db_url, pool_size=2)
    try:
        now = [minute.timestamp() + 1]
        rec = UsageRecorder(sessions=session_factory(engine), clock=lambda: now[0])
        rec.record(key_id, "m1", prompt_tokens=100, completion_tokens=10, cached_tokens=64)
        rec.record(key_id, "m1", prompt_tokens=50, completion_tokens=5, cached_tokens=0)
        rec.record(key_id, "m2", prompt_tokens=7, completion_tokens=3, cached_tokens=0)
        now[0] += 3600  # an hour later
        rec.record(key_id, "m1", prompt_tokens=1, completion_tokens=1, cached_tokens=1)
        await rec.stop()
    finally:
        await engine.dispose()


@pytest.mark.e2e
async def test_usage_sums_per_key_and_model(aclient: httpx.AsyncClient, cp: ControlPlane) -> None:
    key_name = name("metered")
    key_id = _ok(await aclient.post("/keys", json={"name": key_name}), 201)["id"]
    t0 = datetime(2026, 11, 15, 10, 0, tzinfo=UTC)
    await _record_usage(cp, key_id, t0)

    items = _ok(await aclient.get("/usage", params={"key": key_name}))["items"]
    by_model = {i["model"]: i for i in items}
    assert set(by_model) == {"m1", "m2"}
    m1 = by_model["m1"]
    assert (m1["requests"], m1["prompt_tokens"], m1["cached_tokens"], m1["completion_tokens"],
            m1["total_tokens"], m1["key_id"]) == (3, 151, 65, 16, 167, key_id)  # fmt: skip
    assert m1["start"].startswith("2026-11-15T10:00:00") and m1["end"].startswith(
        "2026-11-15T11:01:00"
    )
    # By id too; filtered by model and time; grouped per hour, newest first.
    hourly = _ok(
        await aclient.get("/usage", params={"key": key_id, "model": "m1", "group": "hour"})
    )
    assert [(i["start"][:16], i["requests"]) for i in hourly["items"]] == [
        ("2026-11-15T11:00", 1), ("2026-11-15T10:00", 2),
    ]  # fmt: skip
    late = _ok(
        await aclient.get("/usage", params={"key": key_name, "since": "2026-11-15T10:30:00"})
    )
    assert [(i["model"], i["requests"]) for i in late["items"]] == [("m1", 1)]
    capped = _ok(await aclient.get("/usage", params={"key": key_name, "limit": 1}))
    assert len(capped["items"]) == 1 and capped["truncated"] is True
    _refused(
        await aclient.get(
            "/usage", params={"since": "2026-11-15T10:00:00Z", "until": "2026-11-15"}
        ),
        422,
        "until",
    )


@pytest.mark.e2e
async def test_cli_create_list_revoke_and_usage(cp: ControlPlane) -> None:
    key_name = name("cli")
    made = run_cli(cp, "keys", "create", key_name, "--models", "m1,m2", "--rpm", "10", "--tpm",
                   "500", "--quota", "1000", "--period", "day", "--concurrency", "2",
                   "--expires", "30d", "--cache-salt")  # fmt: skip
    assert made.exit_code == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("llmgw_") and "\n" not in key
    assert "10 requests/min" in made.stderr and "1000 tokens per day" in made.stderr
    assert key not in made.stderr

    listed = run_cli(cp, "keys", "list")
    assert listed.exit_code == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(key_name))
    assert "m1,m2" in row and row.split()[-1] == "False"
    assert key.split("_", 2)[2] not in listed.stdout
    got = run_cli(cp, "get", "keys", key_name, "-o", "json")
    assert got.exit_code == 0 and json.loads(got.stdout)["rate_limit_rpm"] == 10

    key_id = key.split("_")[1]
    await _record_usage(cp, key_id, datetime(2026, 11, 15, 10, 0, tzinfo=UTC))
    table = run_cli(cp, "usage", "--key", key_name, "--since", "2026-11-15")
    assert table.exit_code == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["KEY", "MODEL", "REQUESTS", "PROMPT", "CACHED", "COMPLETION",
                                "TOTAL"]  # fmt: skip
    assert lines[1].split() == [key_name, "m1", "3", "151", "65", "16", "167"]
    as_json = run_cli(cp, "usage", "--key", key_name, "--model", "m2", "-o", "json")
    assert [(i["model"], i["total_tokens"]) for i in json.loads(as_json.stdout)] == [("m2", 10)]
    hourly = run_cli(cp, "usage", "--key", key_name, "--group", "hour", "--model", "m1")
    assert [line.split()[3] for line in hourly.stdout.splitlines()[1:]] == ["1", "2"]

    revoked = run_cli(cp, "keys", "revoke", key_name)
    assert revoked.exit_code == 0 and revoked.stdout.strip() == f"key/{key_name} revoked"
    again = run_cli(cp, "keys", "list")
    assert next(ln for ln in again.stdout.splitlines() if ln.startswith(key_name)).endswith("True")

    bad = run_cli(cp, "keys", "create", name("x"), "--period", "day")
    assert bad.exit_code == 2 and "--period without --quota" in bad.stderr
    bad = run_cli(cp, "keys", "create", name("x"), "--expires", "someday")
    assert bad.exit_code == 2 and "neither a time nor a duration" in bad.stderr
    missing = run_cli(cp, "keys", "revoke", "no-such-key")
    assert missing.exit_code == 2 and "no API key is named" in missing.stderr


def test_cli_times_are_dates_iso_times_or_durations() -> None:
    now = datetime(2026, 11, 15, 12, 0, tzinfo=UTC)
    assert parse_time("2026-12-31", option="--expires") == "2026-12-31T00:00:00+00:00"
    assert parse_time("2026-12-31T18:00:00+02:00", option="--expires") == (
        "2026-12-31T18:00:00+02:00"
    )
    assert parse_time("30d", option="--expires", now=now) == "2026-12-15T12:00:00+00:00"
    assert parse_time("24h", option="--since", now=now, past=True) == "2026-11-14T12:00:00+00:00"
    with pytest.raises(SpecError, match="--since 'yesterday' is neither"):
        parse_time("yesterday", option="--since", past=True)
