"""Request bodies: JSON only where an API expects JSON, and never more than a cap.

The body is read here with llmgw.bodies' capped reader, chunk by chunk as the
server hands it over, and refused with 413 as soon as the total passes the cap
(at once when the declared ``Content-Length`` already does), so the most a
request can make this process hold is the cap, whatever it sends. The app
behind then gets the body replayed in one message. A ``Content-Length`` that
is not a number never gets this far: uvicorn (httptools and h11 alike) answers
it 400 itself. A body sent as something other than JSON is
refused with 415 naming the header to send, instead of a validation error
about "a valid dictionary".

What it must not do: run before authentication (``AdminAuth`` sits outside
it), or read a byte past the cap.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmgw.bodies import BodyTooLarge, ClientGone, declared_length, read_asgi
from llmgw.controlplane.http.errors import error_response

__all__ = ["BodyGuard", "is_json_media_type"]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/<x>+json``, with any parameters (FastAPI's rule)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


class BodyGuard:
    """``setting`` names the knob in the 413 message; JSON is required under ``json_prefixes``;
    paths under ``skip_prefixes`` pass untouched."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        setting: str,
        json_prefixes: tuple[str, ...] = (),
        skip_prefixes: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.setting = setting
        self.json_prefixes = json_prefixes
        # Routes that authenticate first and cap their own bodies (the agent API): reading
        # their bodies here would read before authentication, with the wrong cap.
        self.skip_prefixes = skip_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.skip_prefixes):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        # A POST that carries no body (cordon, suspend: `curl -X POST`) has no media type to check.
        bodyless = headers.get("content-length") == "0" or (
            "content-length" not in headers and "transfer-encoding" not in headers
        )
        if (
            not bodyless
            and scope["method"] in _BODY_METHODS
            and any(scope["path"].startswith(p) for p in self.json_prefixes)
            and not is_json_media_type(headers.get("content-type"))
        ):
            shown = headers.get("content-type") or "none"
            await error_response(
                415,
                "unsupported-media-type",
                f"the body must be JSON sent with `Content-Type: application/json` "
                f"(got Content-Type: {shown[:100]})",
            )(scope, receive, send)
            return
        try:
            body = await read_asgi(
                receive,
                self.max_body_bytes,
                declared_length(headers.get("content-length")),
            )
        except ClientGone:
            return  # the client left: nothing to answer
        except BodyTooLarge:
            await self._too_large(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(
            413,
            "body-too-large",
            f"the request body is larger than {self.max_body_bytes} bytes ({self.setting}); "
            "send a smaller body",
        )(scope, receive, send)
