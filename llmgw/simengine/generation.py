"""The hot routes, `/v1/completions` and `/v1/chat/completions`, as one raw ASGI callable.

The budget is <= 50 us of engine CPU per streamed token with 256 streams.
Measured with bench/simengine.py (256 x 128 tokens, this machine): the same
pre-encoded chunks through FastAPI's StreamingResponse cost 42 us/token on
h11 and 36 on httptools+uvloop; this raw handler 37 and 29-34. Both meet the
target; the raw route keeps ~15% in reserve and lets the handler own
disconnect handling. It validates the body once with pydantic, then writes
each step's pre-encoded chunks in one `send`. A task
per request watches for `http.disconnect` (uvicorn silently drops writes to
a closed connection, so only `receive` reveals a gone client) and aborts the
request, which frees its blocks: a gateway that gave up on a request must
not leave it occupying the batch.

Must NOT schedule or sample (engine.py and the pure core do) nor serve the
other routes (http_app.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Literal, Protocol

from pydantic import ValidationError

from llmgw.errors import AuthError, ConflictError, LlmgwError, NotFoundError, SpecError
from llmgw.simengine.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
)
from llmgw.simengine.chat_template import render_chat
from llmgw.simengine.engine import (
    EngineDeadError,
    EngineLoadingError,
    GenerationParams,
    RequestStream,
    SimEngine,
)
from llmgw.simengine.openai_wire import ResponseEncoder, error_body, usage_dict
from llmgw.simengine.tokenizer import Tokenizer

__all__ = [
    "ASGIApp",
    "GenerationRoutes",
    "Receive",
    "Scope",
    "Send",
    "authorized",
    "chat_token_ids",
    "resolve_model",
    "status_of",
    "unauthorized_body",
    "validation_message",
]


class _HasErrors(Protocol):
    def errors(self) -> Any: ...


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


def status_of(exc: LlmgwError) -> int:
    if isinstance(exc, EngineLoadingError | EngineDeadError):
        return 503
    if isinstance(exc, AuthError):
        return 401
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, ConflictError):
        return 409
    if isinstance(exc, SpecError | ValueError):
        return 400
    return 500


def validation_message(exc: _HasErrors) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()
    )


class GenerationRoutes:
    """The hot routes, as one ASGI callable."""

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine
        self._api_key = engine.config.api_key
        self._routes: dict[str, Literal["completion", "chat"]] = {
            "/v1/completions": "completion",
            "/v1/chat/completions": "chat",
        }

    def handles(self, path: str) -> bool:
        return path in self._routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = self._routes[scope["path"]]
        if scope["method"] != "POST":
            await _reply(send, 405, error_body(f"{scope['path']} accepts POST only", status=405))
            return
        if self._api_key is not None and not authorized(scope, self._api_key):
            await _reply(send, 401, unauthorized_body())
            return
        body = await _read_body(receive)
        try:
            data = json.loads(body)
            request: CompletionRequest | ChatCompletionRequest = (
                CompletionRequest.model_validate(data)
                if kind == "completion"
                else ChatCompletionRequest.model_validate(data)
            )
        except ValidationError as exc:
            await _reply(send, 400, error_body(validation_message(exc), status=400))
            return
        except ValueError as exc:
            await _reply(send, 400, error_body(f"request body is not JSON: {exc}", status=400))
            return
        try:
            model, params = _generation_params(self._engine, kind, request)
            stream = self._engine.submit(params)
        except LlmgwError as exc:
            status = status_of(exc)
            await _reply(send, status, error_body(exc.message, status=status, param=exc.field))
            return
        prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
        encoder = ResponseEncoder(kind, prefix + uuid.uuid4().hex, int(time.time()), model)
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, stream))
        try:
            if request.stream:
                include_usage = bool(
                    request.stream_options and request.stream_options.include_usage
                )
                await self._stream(send, stream, encoder, include_usage)
            else:
                stream.streaming = False
                await self._complete(send, stream, encoder)
        finally:
            watcher.cancel()

    async def _watch_disconnect(self, receive: Receive, stream: RequestStream) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._engine.abort(stream)
                return

    async def _stream(
        self, send: Send, stream: RequestStream, encoder: ResponseEncoder, include_usage: bool
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        first = encoder.first_chunk()
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
        output = stream.output
        deltas = output.deltas
        sent = 0
        while True:
            if stream.aborted:
                # Client gone: nothing to say. Engine gone or stopping: say so in OpenAI's
                # mid-stream error shape, then end the stream, so the client does not hang.
                await send(
                    {"type": "http.response.body", "body": _stream_error(), "more_body": False}
                )
                return
            emitted = stream.num_emitted
            if stream.done:
                body = encoder.token_chunks(
                    deltas,
                    sent,
                    emitted,
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                )
                usage = (
                    usage_dict(stream.num_prompt_tokens, emitted, stream.num_cached_tokens)
                    if include_usage
                    else None
                )
                await send(
                    {
                        "type": "http.response.body",
                        "body": body + encoder.closing(usage),
                        "more_body": False,
                    }
                )
                return
            if emitted > sent:
                body = encoder.token_chunks(deltas, sent, emitted)
                sent = emitted
                await send({"type": "http.response.body", "body": body, "more_body": True})
                continue
            await stream.wait()

    async def _complete(self, send: Send, stream: RequestStream, encoder: ResponseEncoder) -> None:
        while not stream.done:
            if stream.aborted:
                await _reply(send, 503, error_body(_ABORTED, status=503))
                return
            await stream.wait()
        output = stream.output
        body = encoder.full_response(
            output.text,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            usage=usage_dict(
                stream.num_prompt_tokens, stream.num_emitted, stream.num_cached_tokens
            ),
        )
        await _reply(send, 200, body)


_ABORTED = "the engine stopped before the request finished; retry it"


def _stream_error() -> bytes:
    return b"data: " + error_body(_ABORTED, status=503) + b"\n\ndata: [DONE]\n\n"


def resolve_model(engine: SimEngine, name: str | None) -> tuple[str, str | None]:
    """(model name to report, LoRA name or None)."""
    cfg = engine.config
    if name is None or name == cfg.served_model_name:
        return cfg.served_model_name, None
    if cfg.lora_path(name) is not None:
        return name, name
    have = ", ".join([cfg.served_model_name, *(m.name for m in cfg.lora_modules)])
    raise NotFoundError(
        f"The model `{name}` does not exist (this engine serves: {have}).", field="model"
    )


def chat_token_ids(
    tokenizer: Tokenizer, chat: ChatCompletionRequest | TokenizeChatRequest
) -> list[int]:
    """The tokens a chat request is cached under. `/tokenize` and chat completions both call
    this, so a router that tokenizes a conversation gets exactly what the engine caches."""
    text = render_chat(
        chat.messages,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        tools=chat.tools,
    )
    return tokenizer.tokenize(text, add_special_tokens=chat.add_special_tokens)


def _generation_params(
    engine: SimEngine, kind: str, request: CompletionRequest | ChatCompletionRequest
) -> tuple[str, GenerationParams]:
    model, lora_name = resolve_model(engine, request.model)
    if request.n not in (None, 1):
        raise SpecError(f"n={request.n}: the simulator generates one choice; send n=1", field="n")
    tokenizer = engine.tokenizer
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise SpecError("echo=true is not supported by the simulator; drop it", field="echo")
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise SpecError(
                    f"prompt is a batch of {len(prompt)}; the simulator takes one prompt per request",
                    field="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            token_ids = tokenizer.tokenize(prompt, add_special_tokens=request.add_special_tokens)
        else:
            token_ids = list(prompt)  # type: ignore[arg-type]
            bad = [t for t in token_ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise SpecError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                    field="prompt",
                )
        max_tokens = request.max_tokens
    else:
        token_ids = chat_token_ids(tokenizer, request)
        max_tokens = request.max_completion_tokens or request.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise SpecError(f"max_tokens={max_tokens} must be at least 1", field="max_tokens")
    return model, GenerationParams(
        prompt_token_ids=tuple(token_ids),
        max_tokens=max_tokens,
        seed=request.seed,
        temperature=request.temperature,
        stop=request.stop_strings(),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        lora_name=lora_name,
        cache_salt=request.cache_salt or None,
    )


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _reply(send: Send, status: int, body: bytes) -> None:
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def authorized(scope: Scope, api_key: str) -> bool:
    expected = b"Bearer " + api_key.encode()
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return hmac.compare_digest(bytes(value), expected)
    return False


def unauthorized_body() -> bytes:
    return error_body(
        "Unauthorized: send the engine's API key as 'Authorization: Bearer <key>'",
        status=401,
        code="invalid_api_key",
    )
