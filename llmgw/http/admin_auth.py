"""The admin bearer token, checked from the headers alone, before any body is read.

A request under the protected prefix without the right token is refused with
401 before its body is received: an anonymous client must not be able to make
the server read, buffer or parse anything (the issue: a 21 MB unauthenticated
body cost 700 MB of RSS and was answered 400, not 401). The comparison is in
constant time: a byte-by-byte one leaks how much of a guess was right.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from llmgw.http.errors import error_response

__all__ = ["AdminAuth", "admin_token_problem"]


def admin_token_problem(authorization: str | None, expected: str) -> str | None:
    """Why the ``Authorization`` header does not carry ``expected``; None when it does."""
    scheme, _, credentials = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return "missing admin token: send `Authorization: Bearer <admin token>`"
    if not hmac.compare_digest(credentials.strip().encode(), expected.encode()):
        return "wrong admin token; `llmgw up` prints it and writes it to up.json"
    return None


class AdminAuth:
    def __init__(self, app: ASGIApp, *, token: str, prefix: str = "/admin") -> None:
        self.app = app
        self.token = token
        self.prefix = prefix.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if path == self.prefix or path.startswith(self.prefix + "/"):
                problem = admin_token_problem(Headers(scope=scope).get("authorization"), self.token)
                if problem is not None:
                    await error_response(401, "unauthorized", problem)(scope, receive, send)
                    return
        await self.app(scope, receive, send)
