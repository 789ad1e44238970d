"""The Responses routes: `POST /v1/responses` (streamed, not, or in the background),
`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`, the shell over responses.py.

A response is generated from the chat it converts to (responses.py `input_messages`), through
chat's own path (route_io.py), so its prompt is cached and announced exactly as that chat's.
It is stored in this process only (responses.py `ResponseStore`): a foreground response once
it finished, a background one at once (queued) and again when it finishes. Cancelling a
background response aborts its request, which frees its blocks.

Must NOT build response shapes (responses.py) nor route or authenticate (api_routes.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any
from urllib.parse import parse_qs

from llmgw.errors import SpecError
from llmgw.eventloop import cancel_and_wait
from llmgw.logs import get_logger
from llmgw.simengine import responses as resp
from llmgw.simengine.engine import GenerationParams, RequestStream
from llmgw.simengine.generation import Receive, Scope, Send
from llmgw.simengine.openai_wire import error_body
from llmgw.simengine.route_io import ABORTED, SSE_HEADERS, RouteIO, reply, to_json, validate

__all__ = ["ResponsesRoutes"]

_log = get_logger(__name__)


class ResponsesRoutes:
    """The Responses API of one engine process, with its store."""

    def __init__(self, io: RouteIO, *, store: resp.ResponseStore | None = None) -> None:
        self._io = io
        self._store = store if store is not None else resp.ResponseStore()
        # Background responses still generating: their engine stream (what cancel aborts) and
        # the task that records the outcome. Held here because the loop keeps tasks weakly.
        self._background: dict[str, tuple[RequestStream, asyncio.Task[None]]] = {}

    async def close(self) -> None:
        """Stop the background responses' tasks (the engine is stopping)."""
        await cancel_and_wait([task for _, task in self._background.values()])

    def _parse_response_request(self, data: Any) -> resp.ResponsesRequest:
        request = validate(resp.ResponsesRequest, data)
        request.check()
        return request

    def _response_params(
        self, request: resp.ResponsesRequest, previous: resp.StoredResponse | None
    ) -> tuple[str, GenerationParams, list[dict[str, Any]]]:
        messages = resp.input_messages(request, previous)
        chat = {
            "model": request.model,
            "messages": messages,
            "tools": resp.chat_tools(request.tools),
            "chat_template_kwargs": request.chat_template_kwargs,
            **resp.sampling_fields(request),
        }
        model, params = self._io.chat_params(
            chat,
            prompt_field="input",
            max_tokens=request.max_output_tokens,
            max_tokens_field="max_output_tokens",
        )
        return model, params, messages

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        data, large = await self._io.body(scope, receive)
        request = await self._io.off(large, self._parse_response_request, data)
        previous = None
        if request.previous_response_id is not None:
            # On the loop: the store is the loop's alone.
            previous = self._store.get(request.previous_response_id)
            if previous is None:
                raise resp.not_found(request.previous_response_id)
        model, params, messages = await self._io.off(
            large, self._response_params, request, previous
        )
        stream = self._io.engine.submit(params)
        room = self._io.engine.config.scheduler.max_model_len - stream.num_prompt_tokens
        run = _ResponseRun(
            request,
            response_id=resp.new_response_id(),
            item_id=resp.new_item_id(),
            created_at=int(time.time()),
            model=model,
            # What vLLM reports: the limit it sampled with (the room left when none was sent).
            max_output_tokens=room if params.max_tokens is None else params.max_tokens,
            messages=messages,
        )
        if request.background:
            await self._start_background(send, stream, run)
            return
        watcher = self._io.watching(receive, stream)
        try:
            if request.stream:
                await self._stream_response(send, stream, run)
            else:
                await self._complete_response(send, stream, run)
        finally:
            watcher.cancel()

    def _finished(self, stream: RequestStream, run: _ResponseRun) -> dict[str, Any]:
        output = stream.output
        usage = resp.response_usage(
            stream.num_prompt_tokens,
            stream.num_emitted,
            stream.num_cached_tokens,
            self._io.cache_write_tokens(stream),
        )
        return run.body(
            "incomplete" if output.finish_reason == "length" else "completed",
            [resp.message_item(run.item_id, output.text, "completed")],
            usage,
        )

    async def _complete_response(
        self, send: Send, stream: RequestStream, run: _ResponseRun
    ) -> None:
        stream.streaming = False
        while not stream.done:
            if stream.aborted:
                await reply(send, 503, error_body(ABORTED, status=503))
                return
            await stream.wait()
        body = self._finished(stream, run)
        if run.request.store:
            self._store.put(run.response_id, body, run.messages)
        await reply(send, 200, to_json(body))

    async def _stream_response(self, send: Send, stream: RequestStream, run: _ResponseRun) -> None:
        events = resp.ResponseEvents()
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        opening = events.opening(run.body("in_progress", [], None))
        await send({"type": "http.response.body", "body": opening, "more_body": True})
        deltas = stream.output.deltas
        sent = 0
        while True:
            if stream.aborted:
                error = events.error(ABORTED, "engine_stopped")
                await send({"type": "http.response.body", "body": error, "more_body": False})
                return
            emitted = stream.num_emitted
            if emitted > sent:
                chunk = events.text_started(run.item_id) if sent == 0 else b""
                chunk += b"".join(events.text_delta(d) for d in deltas[sent:emitted])
                sent = emitted
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                continue
            if stream.done:
                body = self._finished(stream, run)
                if run.request.store:
                    self._store.put(run.response_id, body, run.messages)
                tail = (events.text_done(stream.output.text) if sent else b"") + events.completed(
                    body
                )
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
            await stream.wait()

    async def _start_background(self, send: Send, stream: RequestStream, run: _ResponseRun) -> None:
        """Answer at once with the queued response (stored), and record the outcome later."""
        queued = run.body("queued", [], None)
        self._store.put(run.response_id, queued, run.messages)
        stream.streaming = False
        task = asyncio.get_running_loop().create_task(self._finish_background(stream, run))
        response_id = run.response_id
        self._background[response_id] = (stream, task)
        task.add_done_callback(lambda _: self._background.pop(response_id, None))
        await reply(send, 200, to_json(queued))

    async def _finish_background(self, stream: RequestStream, run: _ResponseRun) -> None:
        while not stream.done and not stream.aborted:
            await stream.wait()
        entry = self._store.get(run.response_id)
        if entry is None or entry.body["status"] == "cancelled":
            return  # evicted, or cancelled (which aborted the stream): nothing to record
        if stream.done:
            body = self._finished(stream, run)
        else:
            # The engine stopped under it (vLLM marks such a response failed too).
            body = {**entry.body, "status": "failed"}
            _log.warning("background_response_failed", response=run.response_id)
        self._store.update_body(run.response_id, body)

    async def retrieve(self, response_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if query.get("stream", ["false"])[-1].lower() == "true":
            raise SpecError(
                "GET /v1/responses/{id}?stream=true is not supported by the simulator; "
                "drop stream to get the response object",
                field="stream",
            )
        entry = self._store.get(response_id)
        if entry is None:
            raise resp.not_found(response_id)
        await reply(send, 200, to_json(entry.body))

    async def cancel(self, response_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        entry = self._store.get(response_id)
        if entry is None:
            raise resp.not_found(response_id)
        status = entry.body["status"]
        if status not in ("queued", "in_progress"):
            raise resp.cancel_refusal(status)
        body = {**entry.body, "status": "cancelled"}
        self._store.update_body(response_id, body)
        running = self._background.get(response_id)
        if running is not None:
            self._io.engine.abort(running[0])  # frees its blocks; its task sees "cancelled"
        await reply(send, 200, to_json(body))


@dataclasses.dataclass(frozen=True, slots=True)
class _ResponseRun:
    """What one Responses request answers with, fixed when it is submitted."""

    request: resp.ResponsesRequest
    response_id: str
    item_id: str
    created_at: int
    model: str
    max_output_tokens: int
    messages: list[dict[str, Any]]

    def body(
        self,
        status: resp.ResponseStatus,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        return resp.response_object(
            self.request,
            response_id=self.response_id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            output=output,
            usage=usage,
            max_output_tokens=self.max_output_tokens,
        )
