"""The console's routes under ``/ui``: sign-in and sign-out, the pages, their live fragments
(htmx swaps them in place every few seconds) and the forms that act through the admin API.

Every request is checked in this order, before its body is read: a page or fragment needs a
live session cookie (else the sign-in page, or 401 for a fragment); a form post needs the
cookie, a same-origin ``Origin`` (a cross-site post is refused even when the browser sent the
cookie: ports do not make two sites) and then the session's CSRF token from the form. Every
HTML answer carries a Content-Security-Policy without inline script or style, and no-store.
The checks and the answers are the `Console`'s (``web``); this module wires the routes to them.

What it must NOT do: accept the admin token anywhere but the sign-in form's body, put it or a
session id in a URL or a log line, or query the database itself (``admin_calls`` does it).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, date, datetime, timedelta
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import RedirectResponse
from prometheus_client import CollectorRegistry
from starlette.staticfiles import StaticFiles

from llmgw.controlplane.console import fleet_view, routing_view, usage_view, wire
from llmgw.controlplane.console.admin_calls import PAGE_LIMIT, AdminCallError
from llmgw.controlplane.console.sessions import COOKIE
from llmgw.controlplane.console.web import (
    HEADERS,
    PREFIX,
    SESSION_TTL_S,
    Console,
    Refused,
    log,
)
from llmgw.http.throttle import AuthThrottle, client_key
from llmgw.kv.shard_views import ShardViews

__all__ = ["install_console"]

# The usage chart's days, and the CSV export's default and most (UTC days, today included).
_CHART_DAYS = 14
_CSV_DAYS = 31
_CSV_MAX_DAYS = 366
# Rows the CSV export holds at most: the admin API's own page bound.
CSV_MAX_ROWS = 10_000
# Rows of one list a page renders (replicas, attention lines): with the page's other parts
# this keeps its HTML under 100 KB however large the fleet; the rest is counted, not shown.
_MAX_ROWS = 100


def install_console(
    app: FastAPI,
    *,
    admin_token: str,
    registry: CollectorRegistry | None = None,
    kv: ShardViews | None = None,
    throttle: AuthThrottle | None = None,
) -> Console:
    """Mount the console at ``/ui`` on ``app`` (the internal listener's). ``registry`` holds
    the gateway's metrics the Routing page samples; the caller runs ``console.sampler.run``
    for as long as the app serves. ``kv`` is this instance's KV intake (partial views are
    listed under "needs attention"). ``throttle`` counts wrong tokens (the admin API's
    Bearer check's, so both guesses of the one secret share one budget)."""
    console = Console(app, admin_token, registry, kv, throttle)
    app.mount(
        f"{PREFIX}/static",
        StaticFiles(packages=[("llmgw.controlplane.console", "static")]),
        name="console-static",
    )
    router = APIRouter(prefix=PREFIX, include_in_schema=False)
    _routes(router, console)
    app.include_router(router)

    @app.exception_handler(Refused)
    async def _refused(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refused)
        return exc.response

    return console


def _over_tls(request: Request) -> bool:
    """Whether the browser reached us over HTTPS: directly, or through a proxy that
    terminates TLS and says so (trusting the header can only make the cookie stricter)."""
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def _now() -> datetime:
    return datetime.now(UTC)


def _page_and_live(
    router: APIRouter,
    c: Console,
    page: str,
    context: Callable[[], Awaitable[dict[str, Any]]],
) -> None:
    """``/<page>`` (the whole page) and ``/<page>/live`` (the region it refreshes in place),
    rendered from one context: the two never disagree on what a page shows."""

    async def whole(request: Request) -> Response:
        s = c.page_session(request)
        return c.html(f"{page}.html", session=s, page=page, **await context())

    async def live(request: Request) -> Response:
        s = c.fragment_session(request)
        return c.html(f"{page}_live.html", session=s, **await context())

    router.add_api_route(f"/{page}", whole, methods=["GET"], name=page)
    router.add_api_route(f"/{page}/live", live, methods=["GET"], name=f"{page}_live")


def _routes(router: APIRouter, c: Console) -> None:
    # --- sign-in / sign-out --------------------------------------------------------------

    @router.get("/")
    async def sign_in_page(request: Request) -> Response:
        if c.session_of(request) is not None:
            return RedirectResponse(f"{PREFIX}/overview", status_code=303, headers=HEADERS)
        return c.html("sign_in.html")

    @router.get("")
    async def bare(_request: Request) -> Response:
        return RedirectResponse(f"{PREFIX}/", status_code=307)

    @router.post("/sign-in")
    async def sign_in(request: Request) -> Response:
        c.sign_in_throttled(request)  # before the body is read
        fields = await c.form(request, None)
        given = fields.get("token", "").strip()
        # Again: reading the form awaited, and guesses sent at once must not all pass the
        # check above; from here to the record below nothing awaits.
        c.sign_in_throttled(request)
        client = client_key(request.scope)
        if not given or not hmac.compare_digest(given.encode(), c.admin_token.encode()):
            log.warning("console_sign_in_failed")
            if given:
                await c.throttle.failed(client)
            return c.html(
                "sign_in.html",
                status=401,
                error="That is not the admin token (`llmgw up` prints it; up.json holds it).",
            )
        c.throttle.succeeded(client)
        s = c.sessions.create(time.monotonic())
        log.info("console_signed_in", sessions=len(c.sessions))
        r = RedirectResponse(f"{PREFIX}/overview", status_code=303, headers=HEADERS)
        r.set_cookie(
            COOKIE,
            s.id,
            max_age=int(SESSION_TTL_S),
            path=PREFIX,
            httponly=True,
            samesite="strict",
            secure=_over_tls(request),
        )
        return r

    @router.post("/sign-out")
    async def sign_out(request: Request) -> Response:
        s, _ = await c.post_session(request)
        c.sessions.end(s.id)
        log.info("console_signed_out")
        r = RedirectResponse(f"{PREFIX}/", status_code=303, headers=HEADERS)
        r.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
        return r

    # --- declared adapters: a section of the overview and of a deployment's page ----------

    async def adapters(model: str | None = None) -> tuple[list[fleet_view.AdapterRow], bool]:
        """The declared adapters (of ``model`` only, when given) from the admin API's first
        page, and whether more are declared than that page holds."""
        reply = await c.calls.get("/admin/v1/adapters", limit=PAGE_LIMIT)
        items = [a for a in reply.get("items") or [] if model is None or a.get("model") == model]
        return fleet_view.adapter_rows(items), bool(reply.get("next_cursor"))

    def adapters_shown(
        rows: list[fleet_view.AdapterRow], paged: bool, model: str | None = None
    ) -> dict[str, Any]:
        """What adapters_table.html renders: at most ``_MAX_ROWS`` rows, the rest counted."""
        return {
            "adapters": rows[:_MAX_ROWS],
            "more_adapters": max(len(rows) - _MAX_ROWS, 0),
            "adapters_paged": paged,
            "adapters_model": model,
            "adapters_limit": PAGE_LIMIT,
        }

    # --- overview ------------------------------------------------------------------------

    async def overview_context() -> dict[str, Any]:
        nodes = await c.calls.items("nodes")
        deployments = await c.calls.items("deployments")
        replicas = await c.calls.items("replicas")
        adapter_rows, paged = await adapters()
        now = _now()
        attention = fleet_view.attention(
            nodes, deployments, replicas, now=now, stale_sync_s=fleet_view.STALE_SYNC_S,
            kv_not_whole=c.kv.not_whole() if c.kv is not None else None,
            adapters=adapter_rows,
        )  # fmt: skip
        return {
            **adapters_shown(adapter_rows, paged),
            "nodes": [{**n, "gpu_classes": fleet_view.gpus_per_class(n)} for n in nodes],
            "deployments": [
                {**d, "rollout": fleet_view.rollout_text(d), "suspended": fleet_view.suspended(d)}
                for d in deployments
            ],
            "attention": attention[:_MAX_ROWS],
            "more_attention": max(len(attention) - _MAX_ROWS, 0),
            "now": now.strftime("%H:%M:%S UTC"),
            "limit": PAGE_LIMIT,
        }

    _page_and_live(router, c, "overview", overview_context)

    async def _charts_json(
        request: Request, charts: list[dict[str, Any]], **extra: Any
    ) -> Response:
        body = wire.dumps(
            {"at": time.time(), "interval_s": c.sampler.interval_s, "charts": charts, **extra}
        )
        headers = {"Cache-Control": "no-store", "Vary": "Accept-Encoding"}
        if len(body) >= wire.GZIP_MIN_BYTES and wire.accepts_gzip(
            request.headers.get("accept-encoding", "")
        ):
            body = await asyncio.to_thread(wire.gzip_json, body)
            headers["Content-Encoding"] = "gzip"
        return Response(body, media_type="application/json", headers=headers)

    async def _ring_json(request: Request, charts: list[dict[str, Any]], **extra: Any) -> Response:
        # The x axis is always the ring's whole hour: what the ring does not hold (before a
        # restart, during a stall) is an empty stretch, not a squeezed axis.
        window_s = c.sampler.ring.capacity * c.sampler.interval_s
        return await _charts_json(request, charts, window_s=window_s, **extra)

    @router.get("/hit-rates.json")
    async def hit_rates(request: Request) -> Response:
        c.fragment_session(request)
        models = routing_view.table(await c.sampler.read_off_loop())["models"]
        summary = "; ".join(
            f"{m['model']}: "
            + (
                "no decisions yet"
                if m["hit_rate"] is None
                else f"{round(m['hit_rate'] * 100)}% of {m['decisions']} decisions"
            )
            for m in models
        )
        return await _ring_json(
            request,
            [routing_view.hit_rate_chart(c.sampler.ring)],
            summary=summary or "No routing decisions yet.",
        )

    # --- routing -------------------------------------------------------------------------

    async def routing_context() -> dict[str, Any]:
        view = routing_view.table(await c.sampler.read_off_loop())
        # A replica this gateway has not sent a request yet has no model in its metrics: the
        # admin API knows its deployment's.
        models = {d["name"]: d["model"] for d in await c.calls.items("deployments")}
        placed = {
            str(r["id"]): models.get(str(r.get("deployment")), "")
            for r in await c.calls.items("replicas")
        }
        for row in view["replicas"]:
            row["model"] = row["model"] or placed.get(row["replica"], "")
        return {
            **view,
            "interval_s": c.sampler.interval_s,
            "ring_points": c.sampler.ring.capacity,
            "now": _now().strftime("%H:%M:%S UTC"),
        }

    _page_and_live(router, c, "routing", routing_context)

    @router.get("/routing.json")
    async def routing_charts(request: Request) -> Response:
        c.fragment_session(request)
        return await _ring_json(request, routing_view.charts(c.sampler.ring))

    # --- a deployment --------------------------------------------------------------------
    # Names may hold "/" ({name:path}); the routes with a suffix come first, or the bare
    # one would take "x/live" for a deployment named so.

    async def deployment_context(name: str) -> dict[str, Any]:
        d = await c.calls.get(f"/admin/v1/deployments/{quote(name, safe='')}")
        replicas = await c.calls.items("replicas", deployment=name)
        actions = (await c.calls.get("/admin/v1/actions", deployment=name, limit=20)).get(
            "items"
        ) or []
        mine = [r for r in replicas if r.get("deployment") == name]
        try:
            profile = await c.calls.get(f"/admin/v1/profiles/{quote(d['profile'], safe='')}")
        except AdminCallError:
            profile = None  # deleted under it: the page still shows the replicas
        model = str(d.get("model") or "")
        return {
            **adapters_shown(*await adapters(model), model),
            "profile": profile,
            "on_profile": sum(1 for r in mine if not r.get("stale")),
            "d": {**d, "rollout": fleet_view.rollout_text(d), "suspended": fleet_view.suspended(d)},
            "replicas": mine[:_MAX_ROWS],
            "more_replicas": max(len(mine) - _MAX_ROWS, 0),
            "actions": actions,
            "now": _now().strftime("%H:%M:%S UTC"),
        }

    @router.get("/deployments/{name:path}/live")
    async def deployment_live(request: Request, name: str) -> Response:
        s = c.fragment_session(request)
        try:
            ctx = await deployment_context(name)
        except AdminCallError as exc:
            return c.html("error_fragment.html", status=exc.status, message=exc.message)
        return c.html("deployment_live.html", session=s, **ctx)

    @router.get("/deployments/{name:path}")
    async def deployment(request: Request, name: str) -> Response:
        s = c.page_session(request)
        try:
            ctx = await deployment_context(name)
        except AdminCallError as exc:
            return c.html("error.html", status=exc.status, session=s, message=exc.message)
        return c.html("deployment.html", session=s, page="overview", **ctx)

    @router.post("/deployments/{name:path}/scale")
    async def scale(request: Request, name: str) -> Response:
        s, fields = await c.post_session(request)
        wanted = fields.get("replicas", "")
        if not wanted.isdigit() or int(wanted) > 10_000:
            return c.html(
                "error.html", status=422, session=s,
                message="replicas: a whole number from 0 to 10000",
            )  # fmt: skip
        path = f"/admin/v1/deployments/{quote(name, safe='')}"
        if fields.get("confirmed") != "yes":
            # Scaling stops or starts engines: the operator confirms on a page of its own.
            try:
                d = await c.calls.get(path)
            except AdminCallError as exc:
                return c.html("error.html", status=exc.status, session=s, message=exc.message)
            return c.html("confirm_scale.html", session=s, d=d, wanted=int(wanted))
        try:
            await c.calls.post(f"{path}/scale", {"replicas": int(wanted)})
        except AdminCallError as exc:
            return c.html("error.html", status=exc.status, session=s, message=exc.message)
        log.info("console_scaled", deployment=name, replicas=int(wanted))
        return RedirectResponse(
            f"{PREFIX}/deployments/{quote(name, safe='')}", status_code=303, headers=HEADERS
        )

    @router.post("/deployments/{name:path}/{verb}")
    async def suspend_or_resume(request: Request, name: str, verb: str) -> Response:
        s, fields = await c.post_session(request)
        if verb not in ("suspend", "resume"):
            return c.html(
                "error.html", status=404, session=s,
                message="a deployment's actions here are scale, suspend and resume",
            )  # fmt: skip
        path = f"/admin/v1/deployments/{quote(name, safe='')}"
        try:
            if fields.get("confirmed") != "yes":
                # Suspending stops serving: the operator confirms on a page of its own.
                d = await c.calls.get(path)
                return c.html("confirm_suspend.html", session=s, d=d, verb=verb)
            await c.calls.post(f"{path}/{verb}")
        except AdminCallError as exc:
            return c.html("error.html", status=exc.status, session=s, message=exc.message)
        log.info("console_deployment_action", deployment=name, action=verb)
        return RedirectResponse(
            f"{PREFIX}/deployments/{quote(name, safe='')}", status_code=303, headers=HEADERS
        )

    # --- keys and usage ------------------------------------------------------------------

    async def keys_context() -> dict[str, Any]:
        keys = await c.calls.items("keys")
        usage = (await c.calls.get("/admin/v1/usage", limit=PAGE_LIMIT)).get("items") or []
        return {
            "keys": keys,
            "usage": usage,
            "limit": PAGE_LIMIT,
            "csv_max_rows": CSV_MAX_ROWS,
            "now": _now().strftime("%H:%M:%S UTC"),
        }

    _page_and_live(router, c, "keys", keys_context)

    async def daily_usage(days: int, limit: int) -> tuple[list[dict[str, Any]], bool, date]:
        today = _now().date()
        since = datetime.combine(today - timedelta(days=days - 1), datetime.min.time(), UTC)
        reply = await c.calls.get(
            "/admin/v1/usage", group="day", since=since.isoformat(), limit=limit
        )
        return list(reply.get("items") or []), bool(reply.get("truncated")), today

    @router.get("/usage.json")
    async def usage_chart(request: Request) -> Response:
        c.fragment_session(request)
        rows, truncated, today = await daily_usage(_CHART_DAYS, CSV_MAX_ROWS)
        chart = usage_view.daily_chart(rows, today=today, days=_CHART_DAYS)
        return await _charts_json(request, [chart], truncated=truncated)

    @router.get("/usage.csv")
    async def usage_csv(request: Request, days: int = _CSV_DAYS) -> Response:
        c.page_session(request)
        if not 1 <= days <= _CSV_MAX_DAYS:
            return c.html(
                "error.html", status=422,
                message=f"days: a whole number from 1 to {_CSV_MAX_DAYS}",
            )  # fmt: skip
        rows, truncated, today = await daily_usage(days, CSV_MAX_ROWS)
        headers = {
            "Content-Disposition": f'attachment; filename="llmgw-usage-{today.isoformat()}.csv"',
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
        }
        if truncated:
            # More rows matched than one export holds: the operator narrows ``days``.
            headers["X-Llmgw-Truncated"] = f"more than {CSV_MAX_ROWS} rows; ask for fewer days"
        return Response(
            usage_view.usage_csv(rows), media_type="text/csv; charset=utf-8", headers=headers
        )

    @router.post("/keys")
    async def create_key(request: Request) -> Response:
        s, fields = await c.post_session(request)
        body: dict[str, Any] = {"name": fields.get("name", "").strip()}
        models = [m.strip() for m in fields.get("models", "").split(",") if m.strip()]
        if models:
            body["models"] = models
        try:
            created = await c.calls.post("/admin/v1/keys", body)
        except AdminCallError as exc:
            return c.html(
                "keys.html", status=exc.status, session=s, page="keys", error=exc.message,
                **await keys_context(),
            )  # fmt: skip
        log.info("console_key_created", key_id=created.get("id"))
        # Answered here, not redirected: the secret is in this one response and nowhere else.
        return c.html(
            "keys.html", status=201, session=s, page="keys", created=created,
            **await keys_context(),
        )  # fmt: skip

    @router.post("/keys/{name}/revoke")
    async def revoke_key(request: Request, name: str) -> Response:
        s, _ = await c.post_session(request)
        try:
            await c.calls.post(f"/admin/v1/keys/{quote(name, safe='')}/revoke")
        except AdminCallError as exc:
            return c.html("error.html", status=exc.status, session=s, message=exc.message)
        return RedirectResponse(f"{PREFIX}/keys", status_code=303, headers=HEADERS)

    # --- nodes ---------------------------------------------------------------------------

    async def nodes_context() -> dict[str, Any]:
        nodes = await c.calls.items("nodes")
        return {
            "nodes": [{**n, "gpu_classes": fleet_view.gpus_per_class(n)} for n in nodes],
            "now": _now().strftime("%H:%M:%S UTC"),
            "limit": PAGE_LIMIT,
        }

    _page_and_live(router, c, "nodes", nodes_context)

    @router.post("/nodes/{name:path}/{verb}")
    async def node_action(request: Request, name: str, verb: str) -> Response:
        s, fields = await c.post_session(request)
        if verb not in ("approve", "cordon", "uncordon", "drain"):
            return c.html(
                "error.html", status=404, session=s,
                message="a node's actions are approve, cordon, uncordon and drain",
            )  # fmt: skip
        if verb == "drain" and fields.get("confirmed") != "yes":
            # Draining moves every shard off the node: confirmed on a page of its own.
            return c.html("confirm_drain.html", session=s, node=name)
        try:
            await c.calls.post(f"/admin/v1/nodes/{quote(name, safe='')}/{verb}")
        except AdminCallError as exc:
            return c.html("error.html", status=exc.status, session=s, message=exc.message)
        log.info("console_node_action", node=name, action=verb)
        return RedirectResponse(f"{PREFIX}/nodes", status_code=303, headers=HEADERS)
