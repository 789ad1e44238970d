"""What every API-family route (api_routes.py, responses_routes.py) does around its own logic:
read and parse the body under the engine's caps (on a worker thread when it is large), submit
a request converted to chat through chat's own path, count the tokens a request added to the
cache, abort a request whose client left, and answer.

Must NOT know any family's shapes (responses.py, messages.py, embeddings.py do).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ValidationError

from llmgw.errors import SpecError
from llmgw.simengine.api_models import ChatCompletionRequest
from llmgw.simengine.engine import GenerationParams, RequestStream, SimEngine
from llmgw.simengine.generation import Receive, Scope, Send, chat_generation_params, spec_error_of
from llmgw.simengine.limits import OFFLOAD_BODY_BYTES, parse_json_body, read_capped_body

__all__ = ["ABORTED", "SSE_HEADERS", "RouteIO", "reply", "to_json", "validate"]

_M = TypeVar("_M", bound=BaseModel)
_T = TypeVar("_T")

ABORTED: Final = "the engine stopped before the request finished; retry it"
SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_JSON: Final = [(b"content-type", b"application/json")]


class RouteIO:
    """One engine's request plumbing, shared by the family routes."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self._max_body = engine.config.max_body_bytes

    async def body(self, scope: Scope, receive: Receive) -> tuple[Any, bool]:
        """The parsed body, and whether it is large enough that work on it belongs on a
        worker thread (tokenizing a few MB would hold every open stream)."""
        body = await read_capped_body(receive, scope.get("headers", ()), self._max_body)
        large = len(body) > OFFLOAD_BODY_BYTES
        data = await asyncio.to_thread(parse_json_body, body) if large else parse_json_body(body)
        return data, large

    @staticmethod
    async def off(large: bool, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)`, on a worker thread when `large`."""
        return await asyncio.to_thread(fn, *args) if large else fn(*args)

    def chat_params(
        self,
        chat: dict[str, Any],
        *,
        prompt_field: str,
        max_tokens: int | None,
        max_tokens_field: str,
    ) -> tuple[str, GenerationParams]:
        """A converted request's model and generation parameters, through chat's own path.

        The output limit is clamped to the room left in the context, as vLLM 0.32 clamps it
        (serve/utils/api_utils.py get_max_tokens), and is a ceiling (`ignore_eos=False`).
        Thread-safe: it reads the engine's config and tokenizer, never its scheduler.
        """
        request = validate(ChatCompletionRequest, chat)
        request.check()
        try:
            model, params = chat_generation_params(self.engine, request, prompt_field=prompt_field)
        except RecursionError:
            raise SpecError("the request nests too deeply to render; flatten it") from None
        room = self.engine.config.scheduler.max_model_len - len(params.prompt_token_ids)
        if max_tokens is not None and room >= 1:
            max_tokens = min(max_tokens, room)
        return model, dataclasses.replace(
            params, max_tokens=max_tokens, ignore_eos=False, max_tokens_field=max_tokens_field
        )

    def cache_write_tokens(self, stream: RequestStream) -> int:
        """The prompt tokens this request added to the prefix cache, as vLLM counts them
        (v1/metrics/stats.py PrefillStats.finalize): its full prompt blocks less the hit."""
        block_size = self.engine.config.scheduler.block_size
        full = stream.num_prompt_tokens // block_size * block_size
        return max(0, full - stream.num_cached_tokens)

    def watching(self, receive: Receive, stream: RequestStream) -> asyncio.Task[None]:
        """A task that aborts the request (freeing its blocks) if its client disconnects;
        the caller cancels it once the answer is written."""
        return asyncio.get_running_loop().create_task(self._watch_disconnect(receive, stream))

    async def _watch_disconnect(self, receive: Receive, stream: RequestStream) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.engine.abort(stream)
                return


def validate(model: type[_M], data: Any) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise spec_error_of(exc) from None


def to_json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


async def reply(send: Send, status: int, body: bytes) -> None:
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
