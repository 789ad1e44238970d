"""The web console in a real browser (the system's chromium, headless, through Playwright)
against one real `llmgw up`: sign in, see the demo deployment ready, scale it to 3 and watch
the page show 3 ready without a reload, see a crashing shard's reason after a bad profile is
planted, see the Routing page's tables and charts (from the control plane's ring) after some
requests, create a key (its secret shown once), revoke it, see usage per day and download it
as CSV (its rows are the admin API's), approve a pending node, sign out. A cross-site form
post (the browser sends the cookie: another port is the same site) and requests without the
cookie are refused. Page weights and time to first paint are printed; screenshots of every
page land in the test's tmp dir, or in LLMGW_CONSOLE_SHOTS_ALL when set (and the README's
two in docs/console/ with LLMGW_CONSOLE_SHOTS=docs/console).
"""

from __future__ import annotations

import csv
import http.server
import io
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import free_port
from tests.support.waiting import wait_for
from tests.up.up_harness import Up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MAX_PAGE_BYTES = 100 * 1024
# The screenshots the README shows (regenerated with LLMGW_CONSOLE_SHOTS=docs/console).
_DOC_SHOTS = ("overview", "deployment")


@contextmanager
def _cross_site_page(target: str) -> Iterator[str]:
    """Another origin (another port: the same *site*, so SameSite cookies are sent) serving a
    form that posts to ``target``: what a hostile page in another tab could do."""
    html = (
        f'<!doctype html><form method="post" action="{target}">'
        '<input type="hidden" name="replicas" value="0">'
        '<input type="hidden" name="confirmed" value="yes">'
        '<input type="hidden" name="csrf" value="guessed">'
        '<button id="go" type="submit">go</button></form>'
    ).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(html)))
            self.end_headers()
            self.wfile.write(html)

        def log_message(self, *_args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _weigh(page: Any, what: str, html_bytes: int, weights: dict[str, Any]) -> None:
    # The paint entry can land after load: observe it (buffered), give up after 2 s.
    paint = page.evaluate(
        "() => new Promise(done => {"
        " new PerformanceObserver(list => { for (const e of list.getEntries())"
        "  if (e.name === 'first-contentful-paint') done(e.startTime); })"
        " .observe({type: 'paint', buffered: true});"
        " setTimeout(() => done(null), 2000); })"
    )
    total = page.evaluate(
        "() => performance.getEntriesByType('navigation')"
        ".concat(performance.getEntriesByType('resource'))"
        ".reduce((s, e) => s + (e.decodedBodySize || 0), 0)"
    )
    weights[what] = {"html_bytes": html_bytes, "all_bytes": total, "first_paint_ms": paint}
    assert html_bytes < MAX_PAGE_BYTES, (what, html_bytes)


def _shot(page: Any, out: Path, name: str) -> None:
    every = os.environ.get("LLMGW_CONSOLE_SHOTS_ALL")
    page.screenshot(path=str(Path(every) if every else out) + f"/{name}.png", full_page=True)
    docs = os.environ.get("LLMGW_CONSOLE_SHOTS")
    if docs and name in _DOC_SHOTS:
        page.screenshot(path=str(Path(docs) / f"{name}.png"), full_page=True)


def _traffic(gateway: str, api_key: str, *, n: int) -> None:
    """``n`` streamed chat requests sharing a prefix (the later ones can hit it)."""
    with httpx.Client(headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as client:
        for i in range(n):
            body = {
                "model": "demo", "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": "Tell me about fleets " * 40 + str(i)}],
            }  # fmt: skip
            with client.stream("POST", f"{gateway}/chat/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for _ in r.iter_bytes():
                    pass


def _register_pending(admin_url: str, admin: httpx.Client, name: str) -> None:
    token = admin.post("/bootstrap-tokens", json={"require_approval": True, "uses": 1})
    token.raise_for_status()
    r = httpx.post(
        f"{admin_url}/agent/v1/register",
        json={
            "bootstrap_token": token.json()["token"], "node_name": name,
            "mgmt_addr": "127.0.0.1", "inventory": {"cpu_threads": 2, "source": "file"},
        },
        timeout=10,
    )  # fmt: skip
    assert r.status_code in (200, 201) and r.json()["approval_state"] == "pending", r.text


@pytest.mark.skipif(
    CHROMIUM is None, reason="needs the system's chromium (apt-get install chromium)"
)
def test_the_console_in_a_browser(pg_tmp_path: Path, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    up = Up.new(pg_tmp_path).start("--sim-gpus", "4")
    try:
        info = up.wait_up()
        console = info["console_url"]
        base = console.rstrip("/")
        assert console == f"{info['admin_url']}/ui/"
        admin = httpx.Client(
            base_url=info["admin_url"] + "/admin/v1",
            headers={"Authorization": f"Bearer {info['admin_token']}"},
            timeout=30,
        )
        t0 = time.monotonic()
        weights: dict[str, Any] = {}
        problems: list[str] = []
        urls: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            # A CSP violation (inline script or style) is a console error: none may happen.
            page.on(
                "console",
                lambda m: (
                    problems.append(f"{m.text} at {m.location}") if m.type == "error" else None
                ),
            )
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda r: urls.append(r.url))
            expect.set_options(timeout=45_000)

            # --- sign in ---------------------------------------------------------------
            r = page.goto(console)
            assert r is not None and "script-src 'self'" in r.headers["content-security-policy"]
            _weigh(page, "sign-in", len(r.body()), weights)
            _shot(page, tmp_path, "sign-in")
            page.get_by_label("Admin token").fill("not the token")
            page.get_by_role("button", name="Sign in").click()
            expect(page.get_by_role("alert")).to_contain_text("not the admin token")
            page.get_by_label("Admin token").fill(info["admin_token"])
            with page.expect_navigation():
                page.get_by_role("button", name="Sign in").click()
            assert page.url == f"{base}/overview"
            (cookie,) = [c for c in context.cookies() if c["name"] == "llmgw_console"]
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            # Traffic for the Routing page and usage, sent now so the control plane's 10 s
            # sampler has taken it into its ring by the time the page is visited.
            gateway = info["base_url"]
            _traffic(gateway, info["api_key"], n=6)
            traffic_at = time.monotonic()

            # --- the overview: the demo deployment ready ---------------------------------
            demo = page.locator('tr[data-deployment="demo"]')
            expect(demo.locator('[data-field="ready"]')).to_have_text("2")
            html = page.content()
            _weigh(page, "overview", len(html.encode()), weights)
            unlabelled = page.evaluate(
                "() => [...document.querySelectorAll('input:not([type=hidden])')]"
                ".filter(i => i.labels.length === 0).length"
            )
            assert unlabelled == 0

            # --- scale to 3 with confirmation, then 3 ready without a reload ---------------
            page.get_by_role("link", name="demo", exact=True).click()
            page.wait_for_url(f"{base}/deployments/demo")
            page.get_by_label("Replicas").fill("3")
            page.get_by_role("button", name="Scale…").click()
            expect(page.get_by_role("heading", level=1)).to_contain_text("from 2 to 3")
            with page.expect_navigation():
                page.get_by_role("button", name="Scale to 3").click()
            page.evaluate("() => { window.__notReloaded = true; }")
            scaled_at = time.monotonic()
            expect(page.locator("#ready")).to_have_text("3")
            print(f"\nscale 2 -> 3: 3 ready on the page after {time.monotonic() - scaled_at:.1f}s")
            assert page.evaluate("() => window.__notReloaded === true"), "the page reloaded"
            _weigh(page, "deployment", len(page.content().encode()), weights)
            _shot(page, tmp_path, "deployment")
            page.get_by_role("button", name="Suspend…").click()
            expect(page.get_by_role("heading", level=1)).to_have_text("Suspend deployment demo?")
            page.get_by_role("link", name="Cancel").click()
            page.wait_for_url(f"{base}/deployments/demo")
            assert admin.get("/deployments/demo").json()["state"] == "active"

            # --- a planted bad profile: the crashing shard's reason on the overview --------
            admin.post(
                "/profiles",
                json={
                    "name": "broken", "model": "demo", "engine": "sim", "gpu_class": "sim",
                    "model_path": "/models/demo", "args": ["--no-such-flag"],
                },
            ).raise_for_status()  # fmt: skip
            admin.post(
                "/deployments",
                json={"name": "broken", "model": "demo", "profile": "broken", "replicas": 1},
            ).raise_for_status()
            page.get_by_role("link", name="Overview").click()
            page.wait_for_url(f"{base}/overview")
            page.evaluate("() => { window.__notReloaded = true; }")
            attention = page.locator("ul.attention li", has_text="broken")
            expect(attention.first).to_contain_text("exited with code 2")
            assert page.evaluate("() => window.__notReloaded === true")
            _shot(page, tmp_path, "overview")

            # --- routing: the tables now, the charts from the control plane's ring ----------
            page.get_by_role("navigation").get_by_role("link", name="Routing").click()
            page.wait_for_url(f"{base}/routing")
            routing_at = time.monotonic()
            _weigh(page, "routing", len(page.content().encode()), weights)
            row = page.locator('tr[data-model="demo"]')
            # Six of ours, and the one `up` probed the gateway with.
            expect(row.locator('[data-field="decisions"]')).to_have_text(
                re.compile("^([7-9]|1[0-9])$")
            )
            expect(row.locator('[data-field="mode"]')).to_contain_text(re.compile("local|remote"))
            expect(page.locator("tr[data-replica]").first).to_be_visible()
            # Each replica under its model, those not sent a request yet too (the admin API's).
            cells = page.locator('tr[data-replica] [data-field="model"]').all_inner_texts()
            assert cells and set(cells) == {"demo"}, cells
            # The ring samples every 10 s: the sample after the traffic has its decisions.
            decided = page.locator('figure[data-chart="decisions:demo"]')
            page.wait_for_function(
                "() => { const f = document.querySelector("
                "'figure[data-chart=\"decisions:demo\"]');"
                " return f && Number(f.dataset.points) > 0; }",
                timeout=30_000,
            )
            expect(decided.locator("canvas")).to_have_count(1)
            expect(page.locator('figure[data-chart="ttft:demo"] canvas')).to_have_count(1)
            expect(page.locator('figure[data-chart="load"]')).to_be_visible()
            print(
                f"routing page {routing_at - traffic_at:.1f}s after the traffic, its charts "
                f"drawn {time.monotonic() - routing_at:.1f}s later"
            )
            ring = page.request.get(f"{base}/hit-rates.json").json()
            (hit_series,) = ring["charts"][0]["series"]
            assert hit_series["label"] == "demo"
            assert [v for v in hit_series["values"] if v is not None], hit_series
            assert re.search(r"demo: \d+% of ([7-9]|1\d) decisions", ring["summary"]), ring
            _shot(page, tmp_path, "routing")

            # --- keys: create (the secret once), revoke -------------------------------------
            page.get_by_role("link", name="Keys and usage").click()
            page.get_by_label("Name", exact=True).fill("console-test")
            page.get_by_role("button", name="Create key").click()
            secret = page.get_by_label("API key").input_value()
            assert secret.startswith("llmgw_"), secret
            _weigh(page, "keys", len(page.content().encode()), weights)
            models = httpx.get(
                f"{gateway}/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10
            )
            assert models.status_code == 200, models.text
            page.get_by_role("link", name="Keys and usage").click()
            assert secret not in page.content()  # shown once
            with page.expect_navigation():
                page.get_by_role("button", name="Revoke key console-test").click()
            expect(page.locator('tr[data-key="console-test"] .key-status')).to_have_text("revoked")
            assert admin.get("/keys/console-test").json()["disabled"] is True
            usage_chart = page.locator('figure[data-chart="usage-daily"]')
            expect(usage_chart.locator("canvas")).to_have_count(1)
            assert int(usage_chart.get_attribute("data-points") or 0) > 0
            _shot(page, tmp_path, "keys")
            with page.expect_download() as download:
                page.get_by_role("link", name="Download the last 31 days as CSV").click()
            assert download.value.suggested_filename.startswith("llmgw-usage-")
            exported = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
            per_day = admin.get("/usage", params={"group": "day"}).json()["items"]
            assert per_day and len(exported) == len(per_day), (exported, per_day)
            for want, got in zip(per_day, exported, strict=True):
                assert (got["day"], got["key"], got["model"]) == (
                    want["start"][:10], want["key"], want["model"],
                )  # fmt: skip
                assert int(got["requests"]) == want["requests"]
                assert int(got["total_tokens"]) == want["total_tokens"]
            assert sum(int(r["requests"]) for r in exported if r["model"] == "demo") >= 6

            # --- nodes ---------------------------------------------------------------------
            page.get_by_role("link", name="Nodes").click()
            node = admin.get("/nodes").json()["items"][0]["name"]
            # Keyboard: focus stays on a button inside the live region across refreshes.
            page.evaluate(
                "() => { window.__polls = 0; document.addEventListener("
                "'htmx:beforeRequest', () => { window.__polls += 1; }); }"
            )
            page.get_by_role("button", name=f"Cordon node {node}").focus()
            stamp = page.locator("#live .hint").inner_text()
            page.wait_for_function("() => window.__polls >= 2")  # two refreshes came due
            assert page.locator("#live .hint").inner_text() == stamp
            assert page.evaluate("() => document.activeElement.textContent.trim()") == "Cordon"
            page.evaluate("() => document.activeElement.blur()")
            expect(page.locator("#live .hint")).not_to_have_text(stamp)  # and then refreshes
            _weigh(page, "nodes", len(page.content().encode()), weights)
            with page.expect_navigation():
                page.get_by_role("button", name=f"Cordon node {node}").click()
            expect(page.get_by_role("button", name=f"Uncordon node {node}")).to_be_visible()
            assert admin.get(f"/nodes/{node}").json()["cordoned"] is True
            with page.expect_navigation():
                page.get_by_role("button", name=f"Uncordon node {node}").click()
            assert admin.get(f"/nodes/{node}").json()["cordoned"] is False
            page.get_by_role("button", name=f"Drain node {node}").click()
            expect(page.get_by_role("heading", level=1)).to_have_text(f"Drain node {node}?")
            page.get_by_role("link", name="Cancel").click()
            page.wait_for_url(f"{base}/nodes")
            assert admin.get(f"/nodes/{node}").json()["draining"] is False
            _shot(page, tmp_path, "nodes")
            # A node registering with a token that requires approval: pending until approved.
            _register_pending(info["admin_url"], admin, "pending-node")
            approve = page.get_by_role("button", name="Approve node pending-node")
            expect(approve).to_be_visible()  # the live region brought it in
            with page.expect_navigation():
                approve.click()
            assert admin.get("/nodes/pending-node").json()["approval_state"] == "approved"

            # --- a cross-site form post is refused, though the browser sent the cookie -----
            with _cross_site_page(f"{base}/deployments/demo/scale") as evil:
                attacker = context.new_page()
                attacker.goto(evil)
                with attacker.expect_response(f"{base}/deployments/demo/scale") as answer:
                    attacker.click("#go")
                assert answer.value.status == 403
            assert admin.get("/deployments/demo").json()["replicas"] == 3

            # --- sign out: the old cookie opens nothing ------------------------------------
            page.get_by_role("button", name="Sign out").click()
            page.wait_for_url(f"{base}/")
            page.goto(f"{base}/overview")
            assert page.url == f"{base}/"
            browser.close()

        # --- without the cookie (and with the signed-out one): refused ---------------------
        with httpx.Client(base_url=base, timeout=10) as anonymous:
            r = anonymous.post(
                "/deployments/demo/scale", data={"replicas": "0", "confirmed": "yes"}
            )
            assert r.status_code == 403, r.text
            assert anonymous.get("/overview").status_code == 303
            assert anonymous.get("/overview/live").status_code == 401
            anonymous.cookies.set("llmgw_console", cookie["value"])
            assert anonymous.get("/overview").status_code == 303  # signed out
            # Behind a proxy that terminates TLS: the https origin is ours, the cookie Secure.
            host = base.split("/")[2]
            proxied = anonymous.post(
                "/sign-in",
                data={"token": info["admin_token"]},
                headers={"Origin": f"https://{host}", "X-Forwarded-Proto": "https"},
            )
            assert proxied.status_code == 303, proxied.text
            assert "secure" in proxied.headers["set-cookie"].lower()
            big = anonymous.post("/sign-in", data={"token": "x" * 20_000})
            assert big.status_code == 413, big.text
            # Guessing the token: a burst of failures, then 429 with Retry-After.
            for _ in range(12):
                guess = anonymous.post("/sign-in", data={"token": "guess"})
                if guess.status_code != 401:
                    break
            assert guess.status_code == 429 and int(guess.headers["retry-after"]) >= 1
        # Over its budget of wrong tokens this address is refused the right token too (the
        # admin API shares the sign-in's throttle), until the Retry-After passes.
        demo = wait_for(
            lambda: (r := admin.get("/deployments/demo")).status_code == 200 and r.json(),
            timeout_s=15,
            what="the admin API after the guessing's wait",
            interval_s=0.5,
        )
        assert demo["replicas"] == 3

        took_s = time.monotonic() - t0
        print(f"browser part: {took_s:.1f}s")
        for what, w in weights.items():
            print(
                f"{what:>10}: HTML {w['html_bytes'] / 1024:.1f} KB, page with assets "
                f"{w['all_bytes'] / 1024:.1f} KB, first paint {w['first_paint_ms'] or 'n/a'} ms"
            )
        # The one refusal the browser logs on purpose: the wrong token's 401.
        problems = [p for p in problems if not ("401" in p and "/ui/sign-in'" in p)]
        assert not problems, "\n".join(problems)
        assert not [u for u in urls if info["admin_token"] in u]
        log_text = (up.data_dir / "logs" / "controlplane.log").read_text(errors="replace")
        assert info["admin_token"] not in log_text
        assert secret not in log_text
        admin.close()
    finally:
        up.stop()
