"""The admin bearer token, checked from the headers alone, before any body is read.

A request under the protected prefix without the right token is refused with
401 before its body is received: an anonymous client must not be able to make
the server read, buffer or parse anything (the issue: a 21 MB unauthenticated
body cost 700 MB of RSS and was answered 400, not 401). The comparison is in
constant time: a byte-by-byte one leaks how much of a guess was right.

Guessing is throttled (``throttle``): a client over its budget of wrong tokens is
answered 429 with Retry-After before its token is compared, the right one included,
and every wrong token costs its sender a short delay. The console's sign-in shares
the throttle: both guess the same secret.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from llmgw.errors import AuthError, TooManyRequestsError, retry_after
from llmgw.http.errors import render
from llmgw.http.throttle import AuthThrottle, client_key

__all__ = ["AdminAuth", "admin_token_problem", "presented_token"]

_MISSING = "missing admin token: send `Authorization: Bearer <admin token>`"
_WRONG = "wrong admin token; `llmgw up` prints it and writes it to up.json"


def _throttled_message(wait_s: float) -> str:
    return (
        "too many wrong admin tokens from this address: every attempt is refused, the right "
        f"token too, for {retry_after(wait_s)} s (Retry-After); then send the token `llmgw up` "
        "printed (up.json holds it)"
    )


def presented_token(authorization: str | None) -> str | None:
    """The token a ``Bearer`` ``Authorization`` header carries; None when it carries none."""
    scheme, _, credentials = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()


def admin_token_problem(authorization: str | None, expected: str) -> str | None:
    """Why the ``Authorization`` header does not carry ``expected``; None when it does."""
    given = presented_token(authorization)
    if given is None:
        return _MISSING
    if not hmac.compare_digest(given.encode(), expected.encode()):
        return _WRONG
    return None


class AdminAuth:
    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str,
        prefix: str = "/admin",
        throttle: AuthThrottle | None = None,
    ) -> None:
        self.app = app
        self.token = token
        self.prefix = prefix.rstrip("/")
        self.throttle = throttle if throttle is not None else AuthThrottle()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if path == self.prefix or path.startswith(self.prefix + "/"):
                client = client_key(scope)
                # Before the comparison, and with no await between it and the record below:
                # concurrent guesses cannot all pass one check.
                wait_s = self.throttle.refused(client)
                if wait_s is not None:
                    refused = TooManyRequestsError(_throttled_message(wait_s), retry_after_s=wait_s)
                    await render(refused)(scope, receive, send)
                    return
                problem = admin_token_problem(Headers(scope=scope).get("authorization"), self.token)
                if problem is _WRONG:
                    await self.throttle.failed(client)
                elif problem is None:
                    self.throttle.succeeded(client)
                if problem is not None:
                    await render(AuthError(problem))(scope, receive, send)
                    return
        await self.app(scope, receive, send)
