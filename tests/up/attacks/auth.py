"""Attack list cases (see tests/up/attacks/__init__.py): guessing the admin token.

Finding 12: the console's sign-in limiter did not slow guessing (746 guesses/s; a right token
still signed in while "limited") and nothing slowed admin Bearer guesses (~2,000/s). Now a
client over its budget of wrong tokens is refused every attempt, the right token included,
with 429 and Retry-After, until the wait passes (``llmgw.http.throttle``).

Each case leaves the run's clients usable for the cases after it: it waits out the window
(bounded), and the right token then forgives the address's failures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.support.waiting import wait_for

BURST = 50
# The throttle's per-address budget (llmgw.http.throttle.CLIENT_BURST): the refill during the
# burst's own delays may allow one more.
BUDGET = 10
WINDOW_S = 20.0  # bounded wait for Retry-After to pass (one failure's worth is 5 s)


def _record(run: Any, what: str, r: httpx.Response) -> httpx.Response:
    # The status is asserted by the caller (the 401 -> 429 switch is counted, not fixed).
    seen: httpx.Response = run.expect(what, r, r.status_code)
    return seen


def _burst_then_window(
    run: Any, what: str, guess: Callable[[int], httpx.Response], right: Callable[[], httpx.Response]
) -> httpx.Response:
    statuses = [_record(run, f"{what} guess", guess(i)).status_code for i in range(BURST)]
    refused_from = statuses.index(429)
    assert BUDGET <= refused_from <= BUDGET + 2, statuses
    assert set(statuses[:refused_from]) == {401}, statuses
    assert set(statuses[refused_from:]) == {429}, statuses  # and the later ones not compared
    r = _record(run, f"{what}: the right token while over budget", right())
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["retry-after"]) <= 10, r.headers
    assert "right token too" in r.text, r.text

    def through() -> httpx.Response | None:
        got = _record(run, f"{what}: the right token, waiting", right())
        assert got.status_code in (429, 200, 303), got.text
        return got if got.status_code != 429 else None

    return wait_for(through, timeout_s=WINDOW_S, what=f"{what}: the window", interval_s=0.5)


def _admin_bearer_guessing(run: Any) -> None:
    right: str = run.info["admin_token"]
    anonymous: httpx.Client = run.anonymous
    run.expect("admin before guessing", run.admin.get("/admin/v1/models"), 200)

    def bearer(token: str) -> httpx.Response:
        return anonymous.get("/admin/v1/models", headers={"Authorization": f"Bearer {token}"})

    r = _burst_then_window(
        run, "admin bearer", lambda i: bearer(f"guess-{i:04d}-{right[:4]}x"), lambda: bearer(right)
    )
    assert r.status_code == 200, r.text
    # The right token forgave the address: a typo is a 401 again, and the admin client works.
    r = bearer("typo")
    run.expect("admin typo after the window", r, 401)
    run.expect("admin after guessing", run.admin.get("/admin/v1/models"), 200)


def _console_sign_in_guessing(run: Any) -> None:
    right = run.info["admin_token"]
    with httpx.Client(base_url=run.info["admin_url"], timeout=30) as browser:

        def sign_in(token: str) -> httpx.Response:
            return browser.post("/ui/sign-in", data={"token": token})

        r = _burst_then_window(
            run, "console sign-in", lambda i: sign_in(f"guess-{i:04d}"), lambda: sign_in(right)
        )
        assert r.status_code == 303 and "set-cookie" in r.headers, r.headers
    run.expect("admin after sign-in guessing", run.admin.get("/admin/v1/models"), 200)
    run.chat_ok("chat after the guessing")


ATTACKS: list[Callable[[Any], None]] = [_admin_bearer_guessing, _console_sign_in_guessing]
