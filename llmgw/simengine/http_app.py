"""The simulator's HTTP app: FastAPI for everything but generation, which generation.py serves raw.

`/health`, `/metrics`, `/version`, `/v1/models`, `/tokenize`, `/detokenize`,
the control routes (`/pause`, `/unpause`, `/suspend`, `/resume`) and
`/debug/kv_blocks` are ordinary FastAPI; `/v1/completions` and
`/v1/chat/completions` are dispatched to the raw ASGI handler before FastAPI
sees them (see generation.py for why), and so are the other API families,
`/v1/responses` (with GET and cancel), `/v1/messages` (with count_tokens) and
the pooling routes `/v1/embeddings`, `/v1/rerank` and `/v1/score`
(api_routes.py), which own their error shapes and streams. The runtime LoRA
routes (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) are FastAPI too,
attached by lora_routes.py only when runtime updating is allowed. While a load
is in flight, every POST first passes lora_routes' wait, so a request naming
the adapter being loaded waits for it, as in vLLM.

Auth is vLLM's: with an API key set, every `/v1` route needs
`Authorization: Bearer <key>`; `/health`, `/metrics`, `/tokenize` and the
control routes stay open (the shard's front door, its authenticating proxy, is
the security boundary, docs/architecture.md §6). Errors use OpenAI's shape, with the status
vLLM would use.

Must NOT schedule or sample: that is engine.py and the pure core.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmgw.errors import AuthError, LlmgwError, SpecError
from llmgw.simengine.api_models import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from llmgw.simengine.api_routes import ApiRoutes
from llmgw.simengine.engine import SimEngine
from llmgw.simengine.generation import (
    ASGIApp,
    GenerationRoutes,
    Receive,
    Scope,
    Send,
    authorized,
    chat_token_ids,
    resolve_model,
    spec_error_of,
    status_of,
    unauthorized_body,
    validation_message,
)
from llmgw.simengine.limits import OFFLOAD_BODY_BYTES, parse_json_body, read_capped_body
from llmgw.simengine.lora_routes import add_lora_routes, hold_for_pending_load
from llmgw.simengine.openai_wire import error_body

__all__ = ["build_app"]


def build_app(engine: SimEngine) -> ASGIApp:
    """The ASGI app: lifespan starts and stops the engine's loop and publisher."""
    generation = GenerationRoutes(engine)
    families = ApiRoutes(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await families.close()
            await engine.stop()

    api = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    config = engine.config

    async def require_key(request: Request) -> None:
        if config.api_key is not None and not authorized(request.scope, config.api_key):
            raise AuthError("missing or wrong API key")

    @api.exception_handler(LlmgwError)
    async def _llmgw_error(_: Request, exc: LlmgwError) -> Response:
        status = status_of(exc)
        body = (
            unauthorized_body()
            if status == 401
            else error_body(exc.message, status=status, param=exc.field)
        )
        return Response(body, status_code=status, media_type="application/json")

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # Unknown routes and wrong methods answer in OpenAI's shape too: clients parse one shape.
        return Response(
            error_body(str(exc.detail), status=exc.status_code),
            status_code=exc.status_code,
            media_type="application/json",
        )

    @api.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return Response(
            error_body(validation_message(exc.errors()), status=400),
            status_code=400,
            media_type="application/json",
        )

    @api.get("/health")
    async def health() -> Response:
        if engine.dead:
            return Response(
                error_body("the engine's step loop failed; restart it", status=503),
                status_code=503,
                media_type="application/json",
            )
        if not engine.ready:
            return Response(
                error_body("the engine is loading its model", status=503),
                status_code=503,
                media_type="application/json",
            )
        return JSONResponse({"state": engine.state.value})

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _llmgw_version(), "engine": "llmgw-simengine"}

    @api.get("/metrics")
    async def metrics() -> Response:
        engine._update_gauges()
        return Response(
            engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @api.get("/v1/models", dependencies=[Depends(require_key)])
    async def models() -> dict[str, Any]:
        created = int(time.time())
        limit = config.scheduler.max_model_len
        # A load whose time has come is listed even when its caller has not been answered yet.
        engine.adapters.settle(asyncio.get_running_loop().time())
        data: list[dict[str, Any]] = [
            {
                "id": config.served_model_name,
                "object": "model",
                "created": created,
                "owned_by": "llmgw-simengine",
                "root": config.model,
                "parent": None,
                "max_model_len": limit,
            }
        ]
        # --lora-modules and runtime loads alike, in load order, as vLLM lists lora_requests.
        for adapter in engine.adapters.adapters():
            data.append(
                {
                    "id": adapter.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "llmgw-simengine",
                    "root": adapter.path,
                    "parent": config.served_model_name,
                    "max_model_len": limit,
                }
            )
        return {"object": "list", "data": data}

    async def json_body(request: Request) -> tuple[Any, bool]:
        """The parsed body under the same caps as generation, and whether it is large enough
        that the work on it belongs on a worker thread."""
        body = await read_capped_body(
            request.receive, request.scope.get("headers", ()), config.max_body_bytes
        )
        large = len(body) > OFFLOAD_BODY_BYTES
        data = await asyncio.to_thread(parse_json_body, body) if large else parse_json_body(body)
        return data, large

    # The sync halves return rendered responses: encoding millions of token ids is work that
    # belongs on the worker thread too.
    def tokenize_sync(data: Any) -> Response:
        tokenizer = engine.tokenizer
        if isinstance(data, dict) and "messages" in data:
            chat = _validate(TokenizeChatRequest, data)
            resolve_model(engine, chat.model)
            try:
                tokens = chat_token_ids(tokenizer, chat)
            except RecursionError:
                raise SpecError("the request nests too deeply to render; flatten it") from None
            want_strs = chat.return_token_strs
        else:
            plain = _validate(TokenizeCompletionRequest, data)
            resolve_model(engine, plain.model)
            tokens = tokenizer.tokenize(plain.prompt, add_special_tokens=plain.add_special_tokens)
            want_strs = plain.return_token_strs
        return JSONResponse(
            {
                "count": len(tokens),
                "max_model_len": config.scheduler.max_model_len,
                "tokens": tokens,
                "token_strs": [tokenizer.piece(t) for t in tokens] if want_strs else None,
            }
        )

    def detokenize_sync(data: Any) -> Response:
        body = _validate(DetokenizeRequest, data)
        resolve_model(engine, body.model)
        try:
            return JSONResponse({"prompt": engine.tokenizer.detokenize(body.tokens)})
        except ValueError as exc:  # an id outside the vocabulary: the caller's mistake, a 400
            raise SpecError(str(exc), field="tokens") from None

    @api.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        data, large = await json_body(request)
        return await asyncio.to_thread(tokenize_sync, data) if large else tokenize_sync(data)

    @api.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        data, large = await json_body(request)
        return await asyncio.to_thread(detokenize_sync, data) if large else detokenize_sync(data)

    def control_route(signal: Literal["pause", "unpause", "suspend", "resume"]) -> None:
        async def handler() -> dict[str, Any]:
            return {"state": engine.control(signal).value}

        api.post(f"/{signal}", name=signal)(handler)

    for signal in ("pause", "unpause", "suspend", "resume"):
        control_route(signal)

    @api.get("/debug/kv_blocks")
    async def kv_blocks() -> dict[str, Any]:
        return engine.debug_blocks()

    add_lora_routes(api, engine)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["method"] == "POST" and engine.adapters.has_pending:
                held = await hold_for_pending_load(engine, scope, receive, send)
                if held is None:
                    return  # answered already, or the client left
                receive = held
            path = scope["path"]
            if generation.handles(path):
                await generation(scope, receive, send)
                return
            if families.handles(path):
                await families(scope, receive, send)
                return
        await api(scope, receive, send)

    return app


def _llmgw_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmgw")
    except PackageNotFoundError:
        return "unknown"


def _validate(model: Any, data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise spec_error_of(exc) from None
