"""The API families beside completions and chat: OpenAI's Responses (`/v1/responses`, its GET
and cancel), Anthropic's Messages (`/v1/messages`, `/v1/messages/count_tokens`) and the pooling
routes (`/v1/embeddings`, `/v1/rerank`, `/v1/score`), as one raw ASGI callable like
generation.py's.

Responses and Messages are generated as vLLM generates them: converted to a chat request
(responses.py, messages.py), rendered by the chat template and submitted to the engine through
generation.py's `chat_generation_params`, the function chat completions use. Their prompts are
therefore tokenized, cached, scheduled, timed and announced in KV events exactly as the
equivalent chat's, and their usage reports the scheduler's prefix-cache hit. Two rules are
vLLM 0.32's rather than the simulator's chat rules: the output limit (`max_output_tokens`,
Anthropic's required `max_tokens`) is clamped to the room left in the context instead of
refused (serve/utils/api_utils.py get_max_tokens), and it is a ceiling, not a length: the
answer stops at a drawn natural length when that comes first (the simulator's chat emits
exactly `max_tokens`, for benchmarks; a client that must send a limit would otherwise always
get a truncated answer).

Auth is vLLM's --api-key check on every `/v1` route: `Authorization: Bearer <key>` only. vLLM
ignores `x-api-key` (serve/middleware/authenticate.py), so an Anthropic client must send the
key as a bearer token (the anthropic SDK's `auth_token=`); a gateway in front does that.
Errors on the Messages routes are in Anthropic's shape, elsewhere in OpenAI's.

A client that disconnects aborts its request (its blocks are freed), as on the chat routes.

The pooling routes bypass the generation scheduler (no blocks, no KV events) and share one
shell: the body's work (tokenize, pseudo-embed, score; on a worker thread when it is big),
one prefill step of modelled time over its prompt tokens, which `vllm:prompt_tokens` counts.

The Responses routes live in responses_routes.py; this module routes and authenticates all
three families and serves Messages, embeddings, rerank and score (their shapes: embeddings.py,
scores.py).

Must NOT schedule or sample (engine.py), nor build response shapes (the modules above).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, Final

from llmgw.errors import AuthError, LlmgwError, MethodNotAllowedError, NotFoundError, SpecError
from llmgw.http.bodies import ClientGone
from llmgw.simengine import embeddings as emb
from llmgw.simengine import messages as msgs
from llmgw.simengine import responses as resp
from llmgw.simengine import scores as sc
from llmgw.simengine.api_models import TokenizeChatRequest
from llmgw.simengine.engine import (
    EngineDeadError,
    EngineLoadingError,
    GenerationParams,
    RequestStream,
    SimEngine,
)
from llmgw.simengine.generation import (
    Receive,
    Scope,
    Send,
    authorized,
    chat_token_ids,
    resolve_model,
    status_of,
    unauthorized_body,
)
from llmgw.simengine.openai_wire import error_body
from llmgw.simengine.responses_routes import ResponsesRoutes
from llmgw.simengine.route_io import ABORTED, SSE_HEADERS, RouteIO, reply, to_json, validate

__all__ = ["ApiRoutes"]

_RESPONSES: Final = "/v1/responses"
_MESSAGES: Final = "/v1/messages"
_COUNT_TOKENS: Final = "/v1/messages/count_tokens"
_EMBEDDINGS: Final = "/v1/embeddings"
_RERANK: Final = "/v1/rerank"
_SCORE: Final = "/v1/score"
_PATHS: Final = frozenset((_RESPONSES, _MESSAGES, _COUNT_TOKENS, _EMBEDDINGS, _RERANK, _SCORE))
# The score body's fields that may list texts (each is a pseudo-embedding to compute).
_SCORE_LISTS: Final = ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2")
# Embedding floats past which encoding the answer moves to a worker thread (a few ms of JSON).
_OFFLOAD_FLOATS: Final = 64 * 1024

_Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class ApiRoutes:
    """The Responses, Messages and embeddings routes, as one ASGI callable."""

    def __init__(self, engine: SimEngine, *, store: resp.ResponseStore | None = None) -> None:
        self._engine = engine
        self._api_key = engine.config.api_key
        self._io = RouteIO(engine)
        self._responses = ResponsesRoutes(self._io, store=store)

    @staticmethod
    def handles(path: str) -> bool:
        return path in _PATHS or path.startswith(_RESPONSES + "/")

    async def close(self) -> None:
        """Stop the background responses' tasks (the engine is stopping)."""
        await self._responses.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        anthropic = path in (_MESSAGES, _COUNT_TOKENS)
        try:
            if self._api_key is not None and not authorized(scope, self._api_key):
                raise AuthError(
                    "Unauthorized: send the engine's API key as 'Authorization: Bearer <key>' "
                    "(the engine, as vLLM, does not read x-api-key)"
                )
            await self._route(path, scope["method"])(scope, receive, send)
        except ClientGone:
            return  # the client left before its body was complete: no one to answer
        except LlmgwError as exc:
            status = 405 if isinstance(exc, MethodNotAllowedError) else status_of(exc)
            if anthropic:
                body = msgs.error_body(exc.message, status=status)
            elif status == 401:
                body = unauthorized_body()
            else:
                body = error_body(exc.message, status=status, param=exc.field)
            await reply(send, status, body)

    def _route(self, path: str, method: str) -> _Handler:
        routes: dict[str, _Handler]
        if path == _RESPONSES:
            routes = {"POST": self._responses.create}
        elif path == _MESSAGES:
            routes = {"POST": self._create_message}
        elif path == _COUNT_TOKENS:
            routes = {"POST": self._count_tokens}
        elif path == _EMBEDDINGS:
            routes = {"POST": self._embeddings}
        elif path == _RERANK:
            routes = {"POST": self._rerank}
        elif path == _SCORE:
            routes = {"POST": self._score}
        else:
            rest = path[len(_RESPONSES) + 1 :]
            response_id, _, action = rest.partition("/")
            if response_id and not action:
                routes = {"GET": functools.partial(self._responses.retrieve, response_id)}
            elif response_id and action == "cancel":
                routes = {"POST": functools.partial(self._responses.cancel, response_id)}
            else:
                raise NotFoundError(
                    f"no route {path}; the Responses routes are POST /v1/responses, GET "
                    "/v1/responses/{id} and POST /v1/responses/{id}/cancel"
                )
        handler = routes.get(method)
        if handler is None:
            raise MethodNotAllowedError(f"{path} accepts {', '.join(routes)} only")
        return handler

    # ---- /v1/messages ----------------------------------------------------------------------

    def _message_params(self, data: Any) -> tuple[msgs.MessagesRequest, str, GenerationParams]:
        request = validate(msgs.MessagesRequest, data)
        chat = {
            "model": request.model,
            "messages": msgs.chat_messages(request),
            "tools": msgs.chat_tools(request),
            "chat_template_kwargs": request.chat_template_kwargs,
            **request.sampling_fields(),
        }
        model, params = self._io.chat_params(
            chat,
            prompt_field="messages",
            max_tokens=request.max_tokens,
            max_tokens_field="max_tokens",
        )
        return request, model, params

    async def _create_message(self, scope: Scope, receive: Receive, send: Send) -> None:
        data, large = await self._io.body(scope, receive)
        request, model, params = await self._io.off(large, self._message_params, data)
        stream = self._engine.submit(params)
        message_id = msgs.new_message_id()
        watcher = self._io.watching(receive, stream)
        try:
            if request.stream:
                await self._stream_message(send, stream, message_id, model)
            else:
                await self._complete_message(send, stream, message_id, model)
        finally:
            watcher.cancel()

    def _message_ending(
        self, stream: RequestStream
    ) -> tuple[msgs.StopReason, str | None, dict[str, int]]:
        output = stream.output
        reason, sequence = msgs.stop_reason_of(output.finish_reason, output.stop_reason)
        usage = msgs.message_usage(
            stream.num_prompt_tokens,
            stream.num_emitted,
            stream.num_cached_tokens,
            self._io.cache_write_tokens(stream),
        )
        return reason, sequence, usage

    async def _complete_message(
        self, send: Send, stream: RequestStream, message_id: str, model: str
    ) -> None:
        stream.streaming = False
        while not stream.done:
            if stream.aborted:
                await reply(send, 503, msgs.error_body(ABORTED, status=503))
                return
            await stream.wait()
        reason, sequence, usage = self._message_ending(stream)
        body = msgs.message_object(
            message_id,
            model=model,
            text=stream.output.text,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=usage,
        )
        await reply(send, 200, to_json(body))

    async def _stream_message(
        self, send: Send, stream: RequestStream, message_id: str, model: str
    ) -> None:
        events = msgs.MessageEvents()
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        start = events.start(message_id, model, stream.num_prompt_tokens)
        await send({"type": "http.response.body", "body": start, "more_body": True})
        deltas = stream.output.deltas
        sent = 0
        while True:
            if stream.aborted:
                error = events.error(ABORTED)
                await send({"type": "http.response.body", "body": error, "more_body": False})
                return
            emitted = stream.num_emitted
            if emitted > sent:
                chunk = events.text(deltas[sent:emitted])
                sent = emitted
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                continue
            if stream.done:
                tail = events.finish(*self._message_ending(stream))
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
            await stream.wait()

    def _count(self, data: Any) -> int:
        request = validate(msgs.CountTokensRequest, data)
        resolve_model(self._engine, request.model)
        chat = validate(
            TokenizeChatRequest,
            {
                "messages": msgs.chat_messages(request),
                "tools": msgs.chat_tools(request),
                "chat_template_kwargs": request.chat_template_kwargs,
            },
        )
        try:
            return len(chat_token_ids(self._engine.tokenizer, chat))
        except RecursionError:
            raise SpecError("the request nests too deeply to render; flatten it") from None

    async def _count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        data, large = await self._io.body(scope, receive)
        count = await self._io.off(large, self._count, data)
        # vLLM answers the count twice (serving.py count_tokens): context_management is its.
        body = {"input_tokens": count, "context_management": {"original_input_tokens": count}}
        await reply(send, 200, to_json(body))

    # ---- /v1/embeddings --------------------------------------------------------------------

    def _embed(self, data: Any) -> tuple[int, bytes]:
        """(prompt tokens, the answer's bytes); thread-safe like RouteIO.chat_params."""
        request = validate(emb.EmbeddingsRequest, data)
        model, _ = resolve_model(self._engine, request.model)
        request.check(self._engine.config.served_model_name)
        prompts = request.prompts()
        if not prompts:
            raise SpecError("input is empty; send a string, strings or token ids", field="input")
        tokenizer = self._engine.tokenizer
        max_model_len = self._engine.config.scheduler.max_model_len
        vectors: list[list[float] | str] = []
        total = 0
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids, count = tokenizer.tokenize_within(
                    prompt, add_special_tokens=request.add_special_tokens, limit=max_model_len
                )
                if ids is None:
                    raise emb.too_long_error(max_model_len, count, index)
            else:
                ids = prompt
                if len(ids) > max_model_len:
                    raise emb.too_long_error(max_model_len, len(ids), index)
                bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
                if bad:
                    raise SpecError(
                        f"input[{index}] has token ids {bad[:5]} outside the vocabulary "
                        f"(0..{tokenizer.vocab_size - 1}); send ids that /tokenize produced",
                        field="input",
                    )
            if not ids:
                raise SpecError(f"input[{index}] is empty; send at least one token", field="input")
            total += len(ids)
            vector = emb.embedding(ids, request.dimensions)
            vectors.append(emb.encode_embedding(vector, request.encoding_format))
        return total, to_json(emb.embeddings_object(model, vectors, total))

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._pool(scope, receive, send, self._embed, "input")

    # ---- /v1/rerank, /v1/score -------------------------------------------------------------

    def _score_pairs(self, pairs: sc.Pairs, use_activation: bool | None) -> tuple[list[float], int]:
        """(each pair's score, the prompt tokens vLLM's cross-encoder would count)."""
        tokenizer = self._engine.tokenizer
        max_model_len = self._engine.config.scheduler.max_model_len
        special = len(tokenizer.tokenize("", add_special_tokens=True))

        def ids_of(text: str, index: int, field: str, listed: bool) -> list[int]:
            ids, count = tokenizer.tokenize_within(text, limit=max_model_len)
            if ids is None:
                where = f"{field}[{index}]" if listed else field
                raise sc.too_long_error(
                    max_model_len, count + 2 * special, where, field, at_least=True
                )
            return ids

        queries = [
            ids_of(t, i, pairs.query_field, pairs.queries_listed)
            for i, t in enumerate(pairs.queries)
        ]
        documents = [
            ids_of(t, i, pairs.document_field, pairs.documents_listed)
            for i, t in enumerate(pairs.documents)
        ]
        lengths = sc.pair_lengths(queries, documents, special)
        for index, length in enumerate(lengths):
            if length > max_model_len:
                raise sc.too_long_error(
                    max_model_len, length, pairs.label(index), pairs.document_field
                )
        scores = sc.pair_scores(queries, documents, use_activation=use_activation)
        return scores, sum(lengths)

    def _rerank_body(self, data: Any) -> tuple[int, bytes]:
        """(prompt tokens, the answer's bytes); thread-safe like `_embed`."""
        request = validate(sc.RerankRequest, data)
        model, _ = resolve_model(self._engine, request.model)
        pairs = request.pairs()
        scores, total = self._score_pairs(pairs, request.use_activation)
        body = sc.rerank_object(
            sc.request_id_of(request.request_id),
            model,
            pairs.documents,
            scores,
            request.top_n,
            total,
        )
        return total, to_json(body)

    def _score_body(self, data: Any) -> tuple[int, bytes]:
        """(prompt tokens, the answer's bytes); thread-safe like `_embed`."""
        request = validate(sc.ScoreRequest, data)
        model, _ = resolve_model(self._engine, request.model)
        scores, total = self._score_pairs(request.pairs(), request.use_activation)
        body = sc.score_object(sc.request_id_of(request.request_id), model, scores, total)
        return total, to_json(body)

    async def _rerank(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._pool(scope, receive, send, self._rerank_body, "documents")

    async def _score(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._pool(scope, receive, send, self._score_body, *_SCORE_LISTS)

    # ---- the pooling routes' shared shell --------------------------------------------------

    async def _pool(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        work: Callable[[Any], tuple[int, bytes]],
        *list_fields: str,
    ) -> None:
        """Answer a pooling request: `work` turns the body into (prompt tokens, answer), on a
        worker thread when the body is large or one of `list_fields` holds many items (each is
        a pseudo-embedding to compute)."""
        engine = self._engine
        if engine.dead:
            raise EngineDeadError("the engine's step loop failed; see its log, then restart it")
        if not engine.ready:
            raise EngineLoadingError("the engine is loading its model; retry when /health is 200")
        data, large = await self._io.body(scope, receive)
        items = 0
        if isinstance(data, dict):
            items = sum(len(v) for f in list_fields if isinstance(v := data.get(f), list))
        heavy = large or items * emb.EMBEDDING_SIZE > _OFFLOAD_FLOATS
        num_tokens, body = await self._io.off(heavy, work, data)
        # One prefill step of modelled time: what the forward pass would cost on the GPU.
        await asyncio.sleep(engine.config.timing.step_duration_s(num_tokens, 0))
        engine.metrics.prompt_tokens.inc(num_tokens)
        await reply(send, 200, body)
