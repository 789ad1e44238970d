"""The console reads and writes through the admin API itself, in process (an ASGI transport to
the same app, with the admin token), never through SQL of its own.

So every write from a browser is validated, audited and wakes the reconciler exactly as the
same call from `llmgw` or curl would, and the console's pages can never show a state the API
would not. The cost is one JSON encode and decode per call, no socket.

What it must NOT do: hand the token to the browser, or put it in a URL.
"""

from __future__ import annotations

from typing import Any

import httpx
from starlette.types import ASGIApp

__all__ = ["PAGE_LIMIT", "AdminCallError", "AdminCalls"]

# Pages show at most this many of anything: a page's HTML stays small whatever the fleet's size.
PAGE_LIMIT = 200


class AdminCallError(Exception):
    """The admin API refused a call: its status and its own message (which names the fix)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class AdminCalls:
    def __init__(self, app: ASGIApp, token: str) -> None:
        self._client = httpx.AsyncClient(
            # Not the transport's default 127.0.0.1: a guesser on loopback over its budget of
            # wrong tokens must not make the signed-in console's own calls 429 (the throttle
            # counts clients by address; this one only ever sends the right token).
            transport=httpx.ASGITransport(app=app, client=("console-in-process", 0)),
            base_url="http://console.local",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get(self, path: str, **params: Any) -> Any:
        r = await self._client.get(path, params={k: v for k, v in params.items() if v is not None})
        return _reply(r)

    async def items(self, resource: str, **params: Any) -> list[dict[str, Any]]:
        reply = await self.get(f"/admin/v1/{resource}", limit=PAGE_LIMIT, **params)
        return list(reply.get("items") or [])

    async def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        r = await self._client.post(path, json=body if body is not None else {})
        return _reply(r)


def _reply(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        try:
            message = str(r.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = f"the admin API answered {r.status_code}"
        raise AdminCallError(r.status_code, message)
    return r.json() if r.content else None
