"""The hot routes, `/v1/completions` and `/v1/chat/completions`, as one raw ASGI callable.

The budget is <= 50 us of engine CPU per streamed token with 256 streams.
Measured with bench/simengine.py (256 x 128 tokens, this machine): the same
pre-encoded chunks through FastAPI's StreamingResponse cost 42 us/token on
h11 and 36 on httptools+uvloop; this raw handler 37 and 29-34. Both meet the
target; the raw route keeps ~15% in reserve and lets the handler own
disconnect handling. It reads the body under --max-body-bytes (limits.py),
validates it once with pydantic, then writes each step's pre-encoded chunks
in one `send`. Bodies over `OFFLOAD_BODY_BYTES` are parsed and tokenized on
a worker thread: tokenizing is a Python loop, and a prompt of a few MB held
the event loop, and every open stream with it, for seconds. A task
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
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any, Literal

from pydantic import ValidationError

from llmgw.errors import AuthError, ConflictError, LlmgwError, NotFoundError, SpecError, clip
from llmgw.http.bodies import ClientGone
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
    context_length_error,
)
from llmgw.simengine.hf_tokens import HfEngineTokenizer
from llmgw.simengine.limits import (
    OFFLOAD_BODY_BYTES,
    BodyTooLargeError,
    parse_json_body,
    read_capped_body,
)
from llmgw.simengine.lora_runtime import LoraSlotsFullError
from llmgw.simengine.openai_wire import ResponseEncoder, error_body, usage_dict
from llmgw.simengine.tokenizer import EngineTokenizer

__all__ = [
    "ASGIApp",
    "GenerationRoutes",
    "Receive",
    "Scope",
    "Send",
    "authorized",
    "chat_generation_params",
    "chat_token_ids",
    "resolve_model",
    "spec_error_of",
    "status_of",
    "unauthorized_body",
    "validation_message",
]


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
# A prompt of a million wrong items is a million validation errors: the message names the
# first few, enough to fix the request, and counts the rest.
_SHOWN_ERRORS = 3


def status_of(exc: LlmgwError) -> int:
    if isinstance(exc, EngineLoadingError | EngineDeadError | LoraSlotsFullError):
        return 503
    if isinstance(exc, AuthError):
        return 401
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, ConflictError):
        return 409
    if isinstance(exc, BodyTooLargeError):
        return 413
    if isinstance(exc, SpecError | ValueError):
        return 400
    return 500


def validation_message(errors: Sequence[Mapping[str, Any]]) -> str:
    """A validation error's list as one message: its first few errors, each clipped."""
    shown = "; ".join(
        clip(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg', '')}")
        for e in errors[:_SHOWN_ERRORS]
    )
    more = len(errors) - _SHOWN_ERRORS
    return f"{shown} (and {more} more)" if more > 0 else shown


def spec_error_of(exc: ValidationError) -> SpecError:
    """A pydantic error as a 400 whose `param` is the first offending top-level field."""
    # Built once: a million wrong items are a million errors, and building them is seconds.
    errors = exc.errors(include_url=False)
    loc = errors[0].get("loc", ()) if errors else ()
    field = str(loc[0]) if loc else None
    return SpecError(validation_message(errors), field=field)


class GenerationRoutes:
    """The hot routes, as one ASGI callable."""

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine
        self._api_key = engine.config.api_key
        self._max_body = engine.config.max_body_bytes
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
        try:
            body = await read_capped_body(receive, scope.get("headers", ()), self._max_body)
            if len(body) > OFFLOAD_BODY_BYTES:
                request, model, params = await asyncio.to_thread(self._prepare, kind, body)
            else:
                request, model, params = self._prepare(kind, body)
            stream = self._engine.submit(params)
        except ClientGone:
            return  # the client left before its body was complete: no one to answer
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

    def _prepare(
        self, kind: Literal["completion", "chat"], body: bytes
    ) -> tuple[CompletionRequest | ChatCompletionRequest, str, GenerationParams]:
        """Body -> validated request and its tokens. Pure and thread-safe (it may run off the
        loop): it reads the engine's config and tokenizer, never its scheduler."""
        data = parse_json_body(body)
        try:
            request: CompletionRequest | ChatCompletionRequest = (
                CompletionRequest.model_validate(data)
                if kind == "completion"
                else ChatCompletionRequest.model_validate(data)
            )
        except ValidationError as exc:
            raise spec_error_of(exc) from None
        request.check()
        try:
            model, params = _generation_params(self._engine, kind, request)
        except RecursionError:
            # Depth is capped before parsing; this keeps any recursion left a 400, never a 500.
            raise SpecError("the request nests too deeply to render; flatten it") from None
        return request, model, params

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
    """(model name to report, LoRA name or None). May run on a worker thread: it only reads
    the adapter registry (and spends an id, which is atomic)."""
    cfg = engine.config
    if name is None or name == cfg.served_model_name:
        return cfg.served_model_name, None
    if engine.adapters.get(name) is not None:
        return name, name
    if cfg.allow_runtime_lora_updating and name:
        # vLLM's resolve_lora spends a LoRA id on every unknown name before its resolvers
        # (none here) give up; later loads' ids, which KV events carry, count it.
        engine.adapters.note_unknown_model()
    raise engine.adapters.unknown_model(name)


def chat_token_ids(
    tokenizer: EngineTokenizer, chat: ChatCompletionRequest | TokenizeChatRequest
) -> list[int]:
    """The tokens a chat request is cached under. `/tokenize` and chat completions both render
    through `_chat_text`, so a router that tokenizes a conversation gets exactly what the
    engine caches."""
    return tokenizer.tokenize(
        _chat_text(tokenizer, chat), add_special_tokens=chat.add_special_tokens
    )


def _chat_text(
    tokenizer: EngineTokenizer, chat: ChatCompletionRequest | TokenizeChatRequest
) -> str:
    if isinstance(tokenizer, HfEngineTokenizer):
        # The model's own template, as the engine renders it (and the gateway does).
        return tokenizer.chat_text(
            chat.messages,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            tools=chat.tools,
            chat_template_kwargs=chat.chat_template_kwargs,
        )
    return render_chat(
        chat.messages,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        tools=chat.tools,
    )


def _prompt_ids(
    tokenizer: EngineTokenizer,
    text: str,
    *,
    add_special_tokens: bool,
    max_model_len: int,
    field: str,
) -> list[int]:
    """The prompt's ids, refused as vLLM would once they leave no room for output: a prompt
    past the limit is counted, never held in full (see Tokenizer.tokenize_within)."""
    ids, count = tokenizer.tokenize_within(
        text, add_special_tokens=add_special_tokens, limit=max_model_len - 1
    )
    if ids is None:
        raise context_length_error(max_model_len, count, field)
    return ids


def chat_generation_params(
    engine: SimEngine, request: ChatCompletionRequest, *, prompt_field: str = "messages"
) -> tuple[str, GenerationParams]:
    """A chat request's model and generation parameters: what chat completions submits, and
    what the Responses and Messages routes submit for the chat they convert to (api_routes.py),
    so every route renders, tokenizes and caches a conversation one way. `prompt_field` is the
    field an over-long prompt is blamed on. Thread-safe, like `_prepare`."""
    return _generation_params(engine, "chat", request, chat_prompt_field=prompt_field)


def _generation_params(
    engine: SimEngine,
    kind: str,
    request: CompletionRequest | ChatCompletionRequest,
    *,
    chat_prompt_field: str = "messages",
) -> tuple[str, GenerationParams]:
    model, lora_name = resolve_model(engine, request.model)
    max_model_len = engine.config.scheduler.max_model_len
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
            token_ids = _prompt_ids(
                tokenizer,
                prompt,
                add_special_tokens=request.add_special_tokens,
                max_model_len=max_model_len,
                field="prompt",
            )
        else:
            token_ids = list(prompt)  # type: ignore[arg-type]
            # An overlong id list is refused by length (engine.submit) without scanning it all.
            bad = (
                [t for t in token_ids if not 0 <= t < tokenizer.vocab_size]
                if len(token_ids) < max_model_len
                else []
            )
            if bad:
                raise SpecError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                    field="prompt",
                )
        max_tokens = request.max_tokens
        prompt_field, max_tokens_field = "prompt", "max_tokens"
    else:
        prompt_field = chat_prompt_field
        token_ids = _prompt_ids(
            tokenizer,
            _chat_text(tokenizer, request),
            add_special_tokens=request.add_special_tokens,
            max_model_len=max_model_len,
            field=prompt_field,
        )
        # vLLM prefers max_completion_tokens; `is not None`, not `or`: a 0 there is an error to
        # report, not a reason to fall back to max_tokens.
        if request.max_completion_tokens is not None:
            max_tokens, max_tokens_field = request.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_tokens_field = request.max_tokens, "max_tokens"
    return model, GenerationParams(
        prompt_token_ids=tuple(token_ids),
        max_tokens=max_tokens,
        seed=request.seed,
        temperature=request.temperature,
        stop=request.stop_strings(),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        lora_name=lora_name,
        cache_salt=request.cache_salt or None,
        min_tokens=request.min_tokens,
        prompt_field=prompt_field,
        max_tokens_field=max_tokens_field,
    )


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
