"""The web console over real HTTP against a real `llmgw controlplane` (no browser: the
browser test is tests/controlplane/console/test_console_browser.py): only the internal listener serves it,
the cookie's attributes, the checks every form post passes, names holding "/", and pages with
no inline script or style."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.fixture
def signed_in(controlplane: Any) -> Iterator[tuple[httpx.Client, str]]:
    """A browser-like client signed in to the console, and its CSRF token."""
    with httpx.Client(base_url=f"{controlplane.url}/ui", timeout=10) as c:
        r = c.post("/sign-in", data={"token": controlplane.token})
        assert r.status_code == 303 and r.headers["location"] == "/ui/overview", r.text
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
        assert "secure" not in cookie  # plain HTTP: a Secure cookie would never come back
        page = c.get("/overview")
        assert page.status_code == 200, page.text
        (csrf,) = set(re.findall(r'name="csrf" value="([^"]+)"', page.text))
        yield c, csrf


def test_only_the_internal_listener_serves_the_console(controlplane: Any) -> None:
    assert httpx.get(f"{controlplane.public_url}/ui/", timeout=10).status_code == 404
    r = httpx.get(f"{controlplane.url}/ui/", timeout=10)
    assert r.status_code == 200 and 'type="password"' in r.text


def test_scale_a_deployment_whose_name_holds_a_slash(
    controlplane: Any, signed_in: tuple[httpx.Client, str]
) -> None:
    c, csrf = signed_in
    admin = httpx.Client(
        base_url=f"{controlplane.url}/admin/v1", headers=controlplane.headers, timeout=10
    )
    admin.post("/models", json={"name": "team/m"}).raise_for_status()
    admin.post(
        "/profiles",
        json={"name": "team/p", "model": "team/m", "engine": "sim", "model_path": "/m"},
    ).raise_for_status()
    admin.post(
        "/deployments",
        json={"name": "team/chat", "model": "team/m", "profile": "team/p", "replicas": 0},
    ).raise_for_status()

    page = c.get("/deployments/team/chat")
    assert page.status_code == 200 and "Deployment team/chat" in page.text, page.text
    fingerprint = admin.get("/profiles/team/p").json()["fingerprint"]
    assert f"<code>{fingerprint[:16]}</code> (sim, TP 1" in page.text  # the profile's version
    assert c.get("/deployments/team/chat/live").status_code == 200
    ask = c.post("/deployments/team/chat/scale", data={"csrf": csrf, "replicas": "2"})
    assert ask.status_code == 200 and "from 0 to 2" in ask.text  # confirm first
    assert admin.get("/deployments/team/chat").json()["replicas"] == 0

    form = {"csrf": csrf, "replicas": "2", "confirmed": "yes"}
    refused = [
        c.post("/deployments/team/chat/scale", data={**form, "csrf": ""}),
        c.post("/deployments/team/chat/scale", data={**form, "csrf": csrf[:-1] + "x"}),
        c.post("/deployments/team/chat/scale", data=form, headers={"Origin": "http://evil.test"}),
        c.post("/deployments/team/chat/scale", data=form, headers={"Sec-Fetch-Site": "cross-site"}),
    ]
    assert [r.status_code for r in refused] == [403, 403, 403, 403]
    assert admin.get("/deployments/team/chat").json()["replicas"] == 0

    done = c.post("/deployments/team/chat/scale", data=form)
    assert done.status_code == 303, done.text
    assert admin.get("/deployments/team/chat").json()["replicas"] == 2

    # Suspend, confirmed on a page of its own; then resume.
    ask = c.post("/deployments/team/chat/suspend", data={"csrf": csrf})
    assert ask.status_code == 200 and "Suspend deployment team/chat?" in ask.text, ask.text
    assert admin.get("/deployments/team/chat").json()["state"] == "active"
    refused = c.post("/deployments/team/chat/suspend", data={"csrf": "", "confirmed": "yes"})
    assert refused.status_code == 403
    done = c.post("/deployments/team/chat/suspend", data={"csrf": csrf, "confirmed": "yes"})
    assert done.status_code == 303, done.text
    assert admin.get("/deployments/team/chat").json()["state"] == "suspended"
    assert "Resume…" in c.get("/deployments/team/chat").text
    done = c.post("/deployments/team/chat/resume", data={"csrf": csrf, "confirmed": "yes"})
    assert done.status_code == 303, done.text
    assert admin.get("/deployments/team/chat").json()["state"] == "active"
    assert c.post("/deployments/team/chat/explode", data={"csrf": csrf}).status_code == 404
    admin.close()


def test_pages_carry_the_csp_and_no_inline_script_or_style(
    signed_in: tuple[httpx.Client, str],
) -> None:
    c, _ = signed_in
    for path in (
        "/",
        "/overview",
        "/overview/live",
        "/keys",
        "/keys/live",
        "/nodes",
        "/nodes/live",
        "/routing",
        "/routing/live",
    ):
        r = c.get(path, follow_redirects=True)
        assert r.status_code == 200, (path, r.text)
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "style-src 'self'" in csp, path
        assert "unsafe-inline" not in csp
        assert r.headers["cache-control"] == "no-store"
        assert not re.search(r"<script(?![^>]*\bsrc=)", r.text), path
        assert not re.search(r"\sstyle=|<style", r.text), path
        assert not re.search(r"\son[a-z]+=", r.text), path  # no inline event handlers
    hits = c.get("/hit-rates.json").json()
    # Models other tests of this module declared may be listed (xdist decides which ran
    # first on this worker), each with no decision: no request went to any gateway.
    parts = hits["summary"].split("; ")
    assert parts == ["No routing decisions yet."] or all(
        p.endswith(": no decisions yet") for p in parts
    ), hits["summary"]
    assert hits["interval_s"] == 10
    assert hits["window_s"] == 3600  # the x axis: the ring's whole hour
    (chart,) = hits["charts"]
    assert chart["id"] == "hit-rate" and chart["series"] == []  # no decisions, no series
    routing = c.get("/routing.json")
    assert [ch["id"] for ch in routing.json()["charts"]] == ["load"]
    # Gzipped only past 1 KB (a full ring, tests/controlplane/console/test_console_charts.py); varies anyway.
    assert routing.headers["vary"] == "Accept-Encoding"
    assert "content-encoding" not in routing.headers
    csv = c.get("/usage.csv")
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    assert csv.headers["content-disposition"].startswith('attachment; filename="llmgw-usage-')
    assert (
        csv.text
        == "day,key,key_id,model,requests,prompt_tokens,cached_tokens,completion_tokens,total_tokens\r\n"
    )
    assert c.get("/usage.csv", params={"days": "0"}).status_code == 422
    assert c.get("/usage.json").json()["charts"][0]["id"] == "usage-daily"
    with httpx.Client(base_url=str(c.base_url), timeout=10) as anonymous:
        assert anonymous.get("/usage.csv").status_code == 303  # to the sign-in page
        assert anonymous.get("/routing.json").status_code == 401
