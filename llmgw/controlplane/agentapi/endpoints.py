"""The agent API's HTTP shell: three POST routes on the control plane's internal listener.

    REGISTER_PATH  RegisterRequest (bootstrap token in the body)     -> RegisterResponse
    SYNC_PATH      SyncRequest     (Authorization: Bearer llmgwn_...) -> SyncResponse
    KV_PATH        msgpack KvDeltaRequest (same credential)           -> {"result": ...}
    TOKENIZER_PATH TokenizerUpload (same credential)                  -> TokenizerUploadResponse

Order of every request, each step refusing before the next costs anything: the credential
from the headers (401; sync and KV), the declared Content-Length against the endpoint's cap
(413), the body read chunk by chunk and cut off at the cap (413), the parse (400 malformed,
422 against the model, 426 for another protocol version), then the handler. Registration
carries its token in the body, so its cap is small (``register_max_body_bytes``). Every
refusal is a ``ProtocolErrorBody``.

The body is checked on its raw bytes (``llmgw.http.bodies.check_json``: nesting, NaN/Infinity, lone
surrogates) before pydantic parses it, so every listener refuses the same JSON: a 970-deep
body reached registration's error path without a credential and raised RecursionError there.

What it must not do: read a body before authenticating it (sync, KV), echo a token, or
sit behind a middleware that reads bodies first (``BodyGuard`` must skip ``/agent/``).

``install_agent_api`` mounts the routes on an app and ties the API's start and stop to the
app's lifespan: one line in ``create_app``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.responses import Response

from llmgw.config import AgentApiSettings
from llmgw.controlplane.agentapi.errors import refusal
from llmgw.controlplane.agentapi.service import AgentApi, unauthorized
from llmgw.controlplane.agentapi.tokenizers import store_tokenizer
from llmgw.controlplane.instances import InstanceIdentity
from llmgw.errors import (
    BodyTooLargeError,
    ConflictError,
    DatabaseUnavailableError,
    LlmgwError,
    MalformedJsonError,
    ProtocolVersionError,
    SpecError,
    clip,
)
from llmgw.http.bodies import (
    BadJson,
    BodyTooLarge,
    check_json,
    declared_length,
    parse_json,
    read_capped,
)
from llmgw.kv.shard_views import ShardViews
from llmgw.logs import get_logger
from llmgw.protocol.kvstream import KV_PATH
from llmgw.protocol.sync import (
    PROTOCOL_VERSION,
    REGISTER_PATH,
    SYNC_PATH,
    RegisterRequest,
    SyncRequest,
)
from llmgw.protocol.tokenizers import TOKENIZER_PATH, TokenizerUpload
from llmgw.store.credentials import NodeCredential, bearer_credential

__all__ = ["agent_router", "install_agent_api"]

log = get_logger("llmgw.controlplane.agentapi")

M = TypeVar("M", bound=BaseModel)

agent_router = APIRouter(tags=["agent"])


def _api(request: Request) -> AgentApi:
    api: AgentApi = request.app.state.agent_api
    return api


async def _read_body(request: Request, cap: int, setting: str) -> bytes:
    # A Content-Length that is not a number never gets here: uvicorn answers it 400 itself.
    declared = declared_length(request.headers.get("content-length"))
    try:
        return await read_capped(request.stream(), cap, declared)
    except BodyTooLarge:
        raise BodyTooLargeError(
            f"the request body is larger than {cap} bytes (controlplane.agent_api.{setting})",
        ) from None


async def _authenticated_body(
    request: Request, api: AgentApi, endpoint: str, cap: int, setting: str
) -> tuple[NodeCredential, bytes]:
    """The node credential, checked, then the body read under ``cap``: in that order for every
    authenticated endpoint, so an unauthenticated client never makes the API buffer a byte."""
    credential = bearer_credential(request.headers.get("authorization"))
    if credential is None:
        api.metrics.auth_failures.labels(endpoint, "missing_or_malformed").inc()
        raise unauthorized()
    await api.authenticate(credential, endpoint=endpoint)
    return credential, await _read_body(request, cap, setting)


def _peek_version(body: bytes) -> Any:
    try:
        value = parse_json(body)
    except BadJson:
        return None
    return value.get("protocol_version") if isinstance(value, dict) else None


def _version_refusal(version: Any) -> ProtocolVersionError:
    return ProtocolVersionError(
        f"protocol_version {clip(str(version))} is not spoken here (this control plane speaks "
        f"{PROTOCOL_VERSION}); upgrade the older of agent and control plane",
    )


def _parse(model: type[M], body: bytes) -> M:
    try:
        check_json(body)
    except BadJson as exc:
        raise MalformedJsonError(str(exc)) from None
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        version = _peek_version(body)
        if version is not None and version != PROTOCOL_VERSION:
            raise _version_refusal(version) from None
        errors = exc.errors(include_input=False, include_url=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise MalformedJsonError("the body is not valid JSON") from None
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        # The message, never the input: the input may be a token.
        raise SpecError(f"{model.__name__}.{where}: {first['msg']}{more}") from None
    version = getattr(parsed, "protocol_version", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise _version_refusal(version)
    return parsed


def _json(model: BaseModel) -> Response:
    return Response(content=model.model_dump_json(), media_type="application/json")


def _db_down(exc: Exception) -> Response:
    # Unreachable or dropped connection only: any other database error is a bug (500).
    log.warning("agent_api_database_error", error=type(exc).__name__)
    return refusal(DatabaseUnavailableError("the state store is unreachable; retry shortly"))


@agent_router.post(REGISTER_PATH, summary="Register a node with a bootstrap token")
async def register(request: Request) -> Response:
    api = _api(request)
    try:
        handler = api.register  # 503 while the API waits for its database at start
        body = await _read_body(
            request, api.settings.register_max_body_bytes, "register_max_body_bytes"
        )
        parsed = _parse(RegisterRequest, body)
        return _json(await handler.register(parsed))
    except LlmgwError as exc:
        return refusal(exc)
    except (OperationalError, InterfaceError) as exc:
        return _db_down(exc)


@agent_router.post(SYNC_PATH, summary="Report observed state, receive the desired shard set")
async def sync(request: Request) -> Response:
    api = _api(request)
    try:
        handler = api.sync
        credential, body = await _authenticated_body(
            request, api, "sync", api.settings.sync_max_body_bytes, "sync_max_body_bytes"
        )
        parsed = _parse(SyncRequest, body)
        if parsed.node_id != str(credential.node_id):
            raise ConflictError(
                f"the sync names node {clip(parsed.node_id)!r} but the credential is node "
                f"{credential.node_id}'s; a node reports only as itself (check the agent's "
                "state dir holds this node's credential)",
            )
        return _json(await handler.sync(credential, parsed))
    except LlmgwError as exc:
        return refusal(exc)
    except (OperationalError, InterfaceError) as exc:
        return _db_down(exc)


@agent_router.post(KV_PATH, summary="One shard's KV-cache delta (msgpack)")
async def kv_delta(request: Request) -> Response:
    api = _api(request)
    try:
        credential, body = await _authenticated_body(
            request, api, "kv", api.settings.kv_max_body_bytes, "kv_max_body_bytes"
        )
        return Response(
            content=api.kv.handle(credential.node_id, body), media_type="application/json"
        )
    except LlmgwError as exc:
        return refusal(exc)


@agent_router.post(TOKENIZER_PATH, summary="A ready shard's model tokenizer files")
async def tokenizer(request: Request) -> Response:
    api = _api(request)
    try:
        credential, body = await _authenticated_body(
            request,
            api,
            "tokenizer",
            api.settings.tokenizer_max_body_bytes,
            "tokenizer_max_body_bytes",
        )
        parsed = _parse(TokenizerUpload, body)
        return _json(await store_tokenizer(api.sessions, credential.node_id, parsed))
    except LlmgwError as exc:
        return refusal(exc)
    except (OperationalError, InterfaceError) as exc:
        return _db_down(exc)


def install_agent_api(
    app: FastAPI,
    *,
    settings: AgentApiSettings,
    sessions: async_sessionmaker[AsyncSession],
    instance: InstanceIdentity,
    registry: CollectorRegistry,
    intake: ShardViews | None = None,
) -> AgentApi:
    """Mount the agent API on ``app`` and run it inside the app's lifespan (after the app's
    own startup, stopped before the app's own shutdown, so the engine is still there for the
    last heartbeat flush and the instance row's removal)."""
    api = AgentApi(
        settings=settings, sessions=sessions, instance=instance, registry=registry, intake=intake
    )
    app.state.agent_api = api
    app.include_router(agent_router)
    outer = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with outer(a) as state, api.running():
            yield state

    app.router.lifespan_context = lifespan
    return api
