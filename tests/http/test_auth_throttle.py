"""The throttle on guessing a credential (finding 12): wrong tokens cost their client, a client
over its budget is refused before any comparison (the right token too), it recovers after the
wait, many clients together are bounded, and the clients it tracks are bounded.

Before: the console's limiter refused only wrong guesses (a right token still signed in while
"limited": 746 guesses/s) and nothing slowed admin Bearer guesses (~2,000/s).
"""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse
from structlog.testing import capture_logs

from llmgw.controlplane.console import install_console
from llmgw.http.admin_auth import AdminAuth
from llmgw.http.throttle import AuthThrottle, client_key

pytestmark = pytest.mark.timeout(20)

TOKEN = "s3cret-admin-tok"  # 16 characters: what an operator may choose


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _throttle(clock: Clock, **kw: float) -> AuthThrottle:
    settings: dict[str, float] = {
        "client_burst": 5,
        "client_rate_per_s": 0.5,
        "global_burst": 100,
        "global_rate_per_s": 10,
        "failure_delay_s": 0,
        **kw,
    }
    return AuthThrottle(clock=clock, **settings)  # type: ignore[arg-type]


def _admin_app(throttle: AuthThrottle) -> FastAPI:
    app = FastAPI()

    @app.get("/admin/v1/ping")
    async def ping(_request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    app.add_middleware(AdminAuth, token=TOKEN, prefix="/admin", throttle=throttle)
    return app


def _client(app: FastAPI, host: str = "10.0.0.1") -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=(host, 5000)), base_url="http://cp"
    )


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_wrong_bearer_tokens_then_429_even_for_the_right_one_then_recovery() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    with capture_logs() as logs:
        await _guess_then_recover(clock, throttle)
    # Neither the secret nor a guess reaches a log line, the throttle's warning included.
    assert any(e["event"] == "auth_failures_throttled" for e in logs)
    assert TOKEN not in repr(logs) and "guess-" not in repr(logs)


async def _guess_then_recover(clock: Clock, throttle: AuthThrottle) -> None:
    async with _client(_admin_app(throttle)) as c:
        assert (await c.get("/admin/v1/ping", headers=_bearer(TOKEN))).status_code == 200
        statuses = [
            (await c.get("/admin/v1/ping", headers=_bearer(f"guess-{i}"))).status_code
            for i in range(12)
        ]
        assert statuses == [401] * 5 + [429] * 7, statuses
        # Over budget: the right token is refused too, before it is compared.
        r = await c.get("/admin/v1/ping", headers=_bearer(TOKEN))
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "2"  # one failure's worth at 0.5/s
        assert "Retry-After" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "too-many-requests"
        # A missing token is no guess, and is not compared either while over budget.
        assert (await c.get("/admin/v1/ping")).status_code == 429
        clock.now += 2.0
        assert (await c.get("/admin/v1/ping", headers=_bearer(TOKEN))).status_code == 200
        # The right token forgave the failures: a typo now is a 401, not a 429.
        assert (await c.get("/admin/v1/ping", headers=_bearer("typo"))).status_code == 401
        assert (await c.get("/admin/v1/ping", headers=_bearer(TOKEN))).status_code == 200
    # Another address was never limited.
    async with _client(_admin_app(throttle), host="10.0.0.2") as other:
        assert (await other.get("/admin/v1/ping", headers=_bearer(TOKEN))).status_code == 200


async def test_missing_tokens_cost_nothing() -> None:
    throttle = _throttle(Clock())
    async with _client(_admin_app(throttle)) as c:
        for _ in range(20):
            assert (await c.get("/admin/v1/ping")).status_code == 401
        assert (await c.get("/admin/v1/ping", headers=_bearer(TOKEN))).status_code == 200


async def test_each_failure_costs_its_delay_and_the_right_token_none() -> None:
    throttle = _throttle(Clock(), failure_delay_s=0.1)
    async with _client(_admin_app(throttle)) as c:
        started = time.monotonic()
        assert (await c.get("/admin/v1/ping", headers=_bearer("nope"))).status_code == 401
        assert time.monotonic() - started >= 0.1
        started = time.monotonic()
        assert (await c.get("/admin/v1/ping", headers=_bearer(TOKEN))).status_code == 200
        assert time.monotonic() - started < 0.1


def test_concurrent_guesses_cannot_all_pass_one_check() -> None:
    # Each failure is recorded before its delay: the sixth check sees the five before it.
    throttle = _throttle(Clock())
    for _ in range(5):
        assert throttle.refused("a") is None
        throttle.record_failure("a")
    assert throttle.refused("a") is not None


def test_the_global_budget_bounds_many_addresses_but_not_a_known_client() -> None:
    clock = Clock()
    throttle = _throttle(clock, global_burst=20, global_rate_per_s=1)
    throttle.succeeded("operator")
    guesses = 0
    for i in range(100):  # 100 addresses, 3 guesses each
        for _ in range(3):
            if throttle.refused(f"10.1.0.{i}") is None:
                throttle.record_failure(f"10.1.0.{i}")
                guesses += 1
    assert guesses == 20
    wait_s = throttle.refused("10.9.9.9")  # a fresh address waits for the global budget
    assert wait_s is not None and 0 < wait_s <= 1.0
    assert throttle.refused("operator") is None  # who held the token before still tries
    clock.now += 1.0
    assert throttle.refused("10.9.9.9") is None


def test_tracked_clients_are_bounded_least_recently_seen_first() -> None:
    throttle = _throttle(Clock(), max_clients=50, global_burst=10_000)
    throttle.succeeded("operator")
    for i in range(10_000):
        throttle.refused("operator")  # seen: kept
        throttle.record_failure(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(throttle) == 50
    assert "operator" in throttle._clients and throttle._clients["operator"].known


def test_churned_addresses_do_not_evict_a_known_client() -> None:
    # The operator, not seen while a guesser churns addresses and spends the global budget,
    # is still known afterwards: the global budget does not lock it out.
    clock = Clock()
    throttle = _throttle(clock, max_clients=50, global_burst=10_000, global_rate_per_s=1)
    throttle.succeeded("operator")
    for i in range(10_000):
        throttle.record_failure(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(throttle) == 50
    assert throttle.refused("10.9.9.9") is not None  # the global budget is spent
    assert throttle.refused("operator") is None
    # The newest failure is tracked, not evicted in the operator's place.
    assert "10.0.39.15" in throttle._clients


def test_it_logs_once_when_a_client_crosses_its_budget() -> None:
    throttle = _throttle(Clock())
    with capture_logs() as logs:
        for _ in range(5):
            throttle.record_failure("a")
        for _ in range(10):
            throttle.refused("a")
    crossed = [e for e in logs if e["event"] == "auth_failures_throttled"]
    assert len(crossed) == 1 and crossed[0]["log_level"] == "warning"
    assert crossed[0]["client"] == "a"


def test_client_keys() -> None:
    assert client_key({"client": ("192.0.2.7", 1234)}) == "192.0.2.7"
    assert client_key({"client": ("::ffff:192.0.2.7", 1)}) == "192.0.2.7"
    # One IPv6 holder has its /64: its addresses share one budget.
    assert client_key({"client": ("2001:db8::1", 1)}) == client_key({"client": ("2001:db8::ff", 1)})
    assert client_key({"client": ("2001:db8::1", 1)}) == "2001:db8::/64"
    assert client_key({"client": None}) == client_key({}) == "unknown"
    assert client_key({"client": ("testclient", 1)}) == "testclient"


# --- the console's sign-in: the same throttle -------------------------------------------------


async def _sign_in(c: httpx.AsyncClient, token: str) -> httpx.Response:
    return await c.post("/ui/sign-in", data={"token": token})


async def test_console_sign_in_shares_the_throttle_and_refuses_the_right_token_over_budget() -> (
    None
):
    clock = Clock()
    throttle = _throttle(clock)
    app = _admin_app(throttle)
    install_console(app, admin_token=TOKEN, throttle=throttle)
    async with _client(app) as c:
        assert (await _sign_in(c, TOKEN)).status_code == 303
        # Three wrong Bearer tokens and two wrong sign-ins: one budget of five.
        for i in range(3):
            assert (await c.get("/admin/v1/ping", headers=_bearer(f"g{i}"))).status_code == 401
        for i in range(2):
            assert (await _sign_in(c, f"g{i}")).status_code == 401
        r = await _sign_in(c, TOKEN)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1 and "right token too" in r.text
        assert "set-cookie" not in r.headers
        clock.now += 2.0
        r = await _sign_in(c, TOKEN)
        assert r.status_code == 303 and "set-cookie" in r.headers
        # An empty token is no guess.
        for _ in range(10):
            assert (await _sign_in(c, "")).status_code == 401
        assert (await _sign_in(c, TOKEN)).status_code == 303
