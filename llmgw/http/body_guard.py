"""Request bodies: JSON only where an API expects JSON, and never more than a cap.

The body is read here with llmgw.http.bodies' capped reader, chunk by chunk as the
server hands it over, and refused with 413 as soon as the total passes the cap
(at once when the declared ``Content-Length`` already does), so the most a
request can make this process hold is the cap, whatever it sends. The app
behind then gets the body replayed in one message. A ``Content-Length`` that
is not a number never gets this far: uvicorn (httptools and h11 alike) answers
it 400 itself. A body sent as something other than JSON is
refused with 415 naming the header to send, instead of a validation error
about "a valid dictionary".

A JSON body is then checked on its raw bytes (``llmgw.http.bodies.check_json``) before
FastAPI parses it: nested deeper than ``MAX_JSON_DEPTH`` or holding NaN/Infinity,
it is a 400 ``malformed-json``. FastAPI's parser is Python's: ~1000 levels raise
RecursionError (a 500), a few hundred cost a parse and a validation error listing
every level, and NaN passes any ``>= 0`` bound. A lone UTF-16 surrogate is a 422
``spec-invalid`` naming the field that holds it (found by parsing the body, which
the depth bound has made safe): free-form fields (``labels``, apply's documents)
would otherwise carry it to the database, whose encoder raises.

What it must not do: run before authentication (``AdminAuth`` sits outside
it), or read a byte past the cap.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmgw.http.bodies import (
    MAX_JSON_DEPTH,
    BadJson,
    BodyTooLarge,
    ClientGone,
    check_json,
    declared_length,
    json_depth_exceeds,
    lone_surrogate,
    read_asgi,
)
from llmgw.http.errors import error_response

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
        json_body = (
            not bodyless
            and scope["method"] in _BODY_METHODS
            and any(scope["path"].startswith(p) for p in self.json_prefixes)
        )
        if json_body and not is_json_media_type(headers.get("content-type")):
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
        if json_body and body:
            refusal = _json_refusal(body)
            if refusal is not None:
                await refusal(scope, receive, send)
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


def _json_refusal(body: bytes) -> Response | None:
    """The answer to a JSON body ``check_json`` refuses, None for one it lets through."""
    try:
        check_json(body)
    except BadJson as exc:
        escape = lone_surrogate(body)
        if escape is None or json_depth_exceeds(body, MAX_JSON_DEPTH):
            return error_response(400, "malformed-json", str(exc))
        field = _surrogate_field(body)
        return error_response(
            422,
            "spec-invalid",
            f"{field or 'body'}: must be valid Unicode; it holds a lone surrogate ({escape}, "
            "a \\ud800-\\udfff escape without its pair): send the character itself or its "
            "full pair",
            field,
        )
    return None


def _surrogate_field(body: bytes) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate, as the
    admin API names fields (``adapters.0.path``); None when the body does not parse. Only
    called once the depth bound passed: the parse and the walk recurse at most that deep."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    path = _find_surrogate(value)
    return None if not path else ".".join(path)


def _find_surrogate(node: Any) -> list[str] | None:
    if isinstance(node, str):
        return [] if _has_surrogate(node) else None
    items: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        for key, item in node.items():
            if _has_surrogate(key):
                return [key]
            items.append((key, item))
    elif isinstance(node, list):
        items = [(str(i), item) for i, item in enumerate(node)]
    for key, item in items:
        below = _find_surrogate(item)
        if below is not None:
            return [key, *below]
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
