"""What every console route shares: the `Console` (its sessions, the sign-in throttle, the
admin API in process), its HTML answers with their security headers, and the checks a request
passes from its headers alone, before any body is read (`routes` holds the routes).

Every HTML answer carries a Content-Security-Policy without inline script or style, and
no-store. A form post needs a live session cookie, a same-origin ``Origin`` (a cross-site post
is refused even when the browser sent the cookie: ports do not make two sites) and then the
session's CSRF token from the form.
"""

from __future__ import annotations

import hmac
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from jinja2 import Environment, PackageLoader, select_autoescape
from prometheus_client import CollectorRegistry

from llmgw.controlplane.console.admin_calls import AdminCalls
from llmgw.controlplane.console.sampler import RoutingSampler
from llmgw.controlplane.console.sessions import COOKIE, Session, SessionStore
from llmgw.http.throttle import AuthThrottle, client_key, retry_after
from llmgw.kv.shard_views import ShardViews

__all__ = ["CSP", "HEADERS", "PREFIX", "SESSION_TTL_S", "Console", "Refused", "log"]

log = structlog.get_logger("llmgw.console")

PREFIX = "/ui"
SESSION_TTL_S = 12 * 3600.0
SESSION_IDLE_S = 3600.0
REFRESH_S = 3
# A form is a few fields; anything larger is not one of ours.
_MAX_FORM_BYTES = 16 * 1024
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: under it a browser sends `Origin: null` with a form post, and the
    # origin check below could not tell our own forms from a sandboxed attacker's.
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

_env = Environment(
    loader=PackageLoader("llmgw.controlplane.console", "templates"),
    autoescape=select_autoescape(("html",)),
    trim_blocks=True,
    lstrip_blocks=True,
)


class Refused(Exception):
    """A check's answer, raised from inside a route: the handler `install_console` adds
    returns its response as it is."""

    def __init__(self, response: Response) -> None:
        self.response = response


class Console:
    """The state the routes share: sessions, the sign-in throttle, the admin API in process."""

    def __init__(
        self,
        app: FastAPI,
        admin_token: str,
        registry: CollectorRegistry | None = None,
        kv: ShardViews | None = None,
        throttle: AuthThrottle | None = None,
    ) -> None:
        self.sessions = SessionStore(ttl_s=SESSION_TTL_S, idle_s=SESSION_IDLE_S)
        # Wrong tokens cost the client that sent them; over its budget every sign-in from it
        # is refused before the token is compared. The admin API's Bearer check shares it
        # (``internal_app`` hands both the same one): both guess the same secret.
        self.throttle = throttle if throttle is not None else AuthThrottle()
        self.admin_token = admin_token
        self.calls = AdminCalls(app, admin_token)
        # The routing charts' ring: the app's lifespan runs ``sampler.run``.
        self.sampler = RoutingSampler(registry)
        # This instance's KV views (the one the router reads): which are held only in part.
        self.kv = kv

    # --- answers -----------------------------------------------------------------------

    def html(
        self,
        template: str,
        status: int = 200,
        session: Session | None = None,
        **context: Any,
    ) -> HTMLResponse:
        body = _env.get_template(template).render(
            prefix=PREFIX,
            refresh_s=REFRESH_S,
            csrf=session.csrf if session else "",
            signed_in=session is not None,
            **context,
        )
        return HTMLResponse(body, status_code=status, headers=dict(HEADERS))

    def refuse(self, request: Request, status: int, message: str) -> Response:
        log.warning("console_refused", status=status, path=request.url.path, why=message)
        return self.html("error.html", status=status, message=message)

    # --- checks (from headers only: before any body is read) ------------------------------

    def sign_in_throttled(self, request: Request) -> None:
        """Refuse a sign-in from a client over its budget of wrong tokens (429, Retry-After),
        before its token is compared, the right one included."""
        wait_s = self.throttle.refused(client_key(request.scope))
        if wait_s is not None:
            r = self.refuse(
                request,
                429,
                f"too many wrong tokens from this address: every sign-in is refused, the "
                f"right token too, for {retry_after(wait_s)} s; then try again",
            )
            r.headers["Retry-After"] = retry_after(wait_s)
            raise Refused(r)

    def session_of(self, request: Request) -> Session | None:
        return self.sessions.get(request.cookies.get(COOKIE), time.monotonic())

    def page_session(self, request: Request) -> Session:
        s = self.session_of(request)
        if s is None:
            raise Refused(RedirectResponse(f"{PREFIX}/", status_code=303, headers=HEADERS))
        return s

    def fragment_session(self, request: Request) -> Session:
        s = self.session_of(request)
        if s is None:
            # htmx follows HX-Redirect: an expired session lands on the sign-in page.
            raise Refused(
                Response(status_code=401, headers={**HEADERS, "HX-Redirect": f"{PREFIX}/"})
            )
        return s

    def same_origin(self, request: Request) -> bool:
        origin = request.headers.get("origin")
        if request.headers.get("sec-fetch-site") == "cross-site":
            return False
        if origin is None:
            # Browsers send Origin with every POST; a client without one is not a browser
            # page another site controls (curl, a test), and still needs cookie and token.
            return True
        # Host and port only: behind a proxy that terminates TLS the browser's origin is
        # https:// while this listener sees plain HTTP; the Host header is the same.
        sent = urlsplit(origin).netloc
        return bool(sent) and hmac.compare_digest(
            sent.encode(), request.headers.get("host", "").encode()
        )

    async def form(self, request: Request, session: Session | None) -> dict[str, str]:
        """The posted form, after the origin (and, with a session, the CSRF token) check."""
        if not self.same_origin(request):
            raise Refused(self.refuse(request, 403, "cross-site form posts are refused"))
        length = request.headers.get("content-length")
        if length is None or not length.isdigit() or int(length) > _MAX_FORM_BYTES:
            raise Refused(self.refuse(request, 413, f"a form is at most {_MAX_FORM_BYTES} bytes"))
        raw = await request.body()
        fields = {
            k: v[0]
            for k, v in parse_qs(
                raw[:_MAX_FORM_BYTES].decode("utf-8", "replace"), max_num_fields=50
            ).items()
        }
        if session is not None and not SessionStore.csrf_ok(session, fields.get("csrf")):
            raise Refused(
                self.refuse(
                    request, 403, "the form's CSRF token is missing or stale: reload the page"
                )
            )
        return fields

    async def post_session(self, request: Request) -> tuple[Session, dict[str, str]]:
        s = self.session_of(request)
        if s is None:
            raise Refused(self.refuse(request, 403, "sign in first (no live session)"))
        return s, await self.form(request, s)
