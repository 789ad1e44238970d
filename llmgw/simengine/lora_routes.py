"""vLLM's runtime LoRA routes, and the wait that holds a request for an adapter still loading.

`POST /v1/load_lora_adapter` `{"lora_name", "lora_path", "load_inplace"?, "is_3d_lora_weight"?}`
and `POST /v1/unload_lora_adapter` `{"lora_name", "lora_int_id"?}` behave as in vLLM 0.32
(`vllm/entrypoints/serve/lora/api_router.py` and `protocol.py`,
`vllm/entrypoints/openai/models/serving.py`):

- They exist only when runtime updating is allowed (`VLLM_ALLOW_RUNTIME_LORA_UPDATING` is 1 or
  true). Otherwise they are unknown paths and answer 404, as vLLM never attaches its router.
- Like every `/v1` route they need the API key. The body must be sent as `application/json`
  (vLLM's `validate_json_request`; any other content type is a 400).
- Success is a 200 whose body is the bare text `Success: LoRA adapter '<name>' added
  successfully.` (or `removed successfully.`), with no content type: vLLM returns a plain
  `Response`. Errors have vLLM's statuses and messages in the engine's OpenAI error shape.
- A load answers after `--lora-load-time-s`, the modelled read from disk. Until then the adapter
  is not registered.
- `is_3d_lora_weight` and `lora_int_id` are accepted and ignored. vLLM ignores `lora_int_id`
  too, and the simulator has no MoE weights for `is_3d_lora_weight` to describe.

vLLM serialises loading, unloading and resolving one adapter name with a per-name lock
(`lora_resolver_lock`). So a request that names an adapter whose load is running waits for the
load and then runs. Only when the load fails does it get the 404 of an unknown model.
`hold_for_pending_load` does this wait before any route sees the request. It reads a body only
while a load is running, so other requests pay nothing for it.

Must NOT decide anything about adapters (lora_runtime.py does): this module reads bodies,
checks the path on disk, waits, logs and answers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import MutableMapping
from typing import Any, Final, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError

from llmgw.errors import AuthError, LlmgwError, SpecError, clip
from llmgw.http.bodies import ClientGone
from llmgw.logs import get_logger
from llmgw.simengine.engine import SimEngine
from llmgw.simengine.generation import (
    Receive,
    Scope,
    Send,
    authorized,
    spec_error_of,
    status_of,
    unauthorized_body,
)
from llmgw.simengine.limits import OFFLOAD_BODY_BYTES, parse_json_body, read_capped_body
from llmgw.simengine.openai_wire import error_body
from llmgw.simengine.route_io import reply

__all__ = [
    "LOAD_PATH",
    "UNLOAD_PATH",
    "LoadLoraAdapterRequest",
    "UnloadLoraAdapterRequest",
    "add_lora_routes",
    "hold_for_pending_load",
    "wait_for_adapter_load",
]

_log = get_logger(__name__)

LOAD_PATH: Final = "/v1/load_lora_adapter"
UNLOAD_PATH: Final = "/v1/unload_lora_adapter"

_M = TypeVar("_M", bound=BaseModel)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's LoadLoRAAdapterRequest: unknown fields are ignored, as its plain BaseModel does."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = Field(default=None)


def add_lora_routes(api: FastAPI, engine: SimEngine) -> None:
    """Attach the two routes when runtime updating is allowed; otherwise leave them absent."""
    config = engine.config
    if not config.allow_runtime_lora_updating:
        return
    registry = engine.adapters

    def check_key(request: Request) -> None:
        if config.api_key is not None and not authorized(request.scope, config.api_key):
            raise AuthError("missing or wrong API key")

    async def body_of(request: Request, model: type[_M]) -> _M:
        content_type = request.headers.get("content-type", "").lower()
        if content_type.split(";", 1)[0].strip() != "application/json":
            raise SpecError("Unsupported Media Type: Only 'application/json' is allowed")
        raw = await read_capped_body(
            request.receive, request.scope.get("headers", ()), config.max_body_bytes
        )
        try:
            return model.model_validate(parse_json_body(raw))
        except ValidationError as exc:
            raise spec_error_of(exc) from None

    @api.post(LOAD_PATH)
    async def load_lora_adapter(request: Request) -> Response:
        check_key(request)
        body = await body_of(request, LoadLoraAdapterRequest)
        name = body.lora_name
        await wait_for_adapter_load(engine, name)
        loop = asyncio.get_running_loop()
        try:
            pending = registry.begin_load(
                name,
                body.lora_path,
                now=loop.time(),
                busy=engine.scheduler.running_lora_ids(),
                path_exists=_path_exists,
                load_inplace=body.load_inplace,
            )
        except LlmgwError as exc:
            _log.warning(
                "lora_adapter_load_refused", adapter=clip(name), error=exc.message, code=exc.code
            )
            raise
        _log.info(
            "lora_adapter_loading",
            adapter=name,
            lora_id=pending.adapter.lora_id,
            path=pending.adapter.path,
            in_place=pending.in_place,
            evicted=[a.name for a in pending.held.evicted],
            load_time_s=registry.load_time_s,
        )
        await wait_for_adapter_load(engine, name)
        _log.info("lora_adapter_loaded", adapter=name, lora_id=pending.adapter.lora_id)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    @api.post(UNLOAD_PATH)
    async def unload_lora_adapter(request: Request) -> Response:
        check_key(request)
        body = await body_of(request, UnloadLoraAdapterRequest)
        name = body.lora_name
        await wait_for_adapter_load(engine, name)
        adapter = registry.unload(name)
        _log.info("lora_adapter_unloaded", adapter=name, lora_id=adapter.lora_id)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)


async def wait_for_adapter_load(engine: SimEngine, name: str) -> None:
    """Until no load of `name` is in flight, registering it when its time has come."""
    registry = engine.adapters
    loop = asyncio.get_running_loop()
    while (ready_at := registry.pending_until(name)) is not None:
        delay = ready_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        # A sleep may end a clock tick early. Then settle registers nothing and the loop waits
        # the remainder, so this never spins.
        registry.settle(loop.time())


async def hold_for_pending_load(
    engine: SimEngine, scope: Scope, receive: Receive, send: Send
) -> Receive | None:
    """The `receive` a route should read its body from, after waiting out a load of the adapter
    the body's `model` names. Returns None when this function has already answered (a body over
    the cap) or the client has gone.

    The body is read only while some load is in flight. Otherwise `receive` comes back
    untouched, and a request costs one dict check.
    """
    registry = engine.adapters
    if not registry.has_pending:
        return receive
    registry.settle(asyncio.get_running_loop().time())
    if not registry.has_pending or scope["path"] in (LOAD_PATH, UNLOAD_PATH):
        return receive
    config = engine.config
    if (
        config.api_key is not None
        and scope["path"].startswith("/v1")
        and not authorized(scope, config.api_key)
    ):
        return receive  # the route answers 401 without waiting, as vLLM's auth comes first
    try:
        body = await read_capped_body(receive, scope.get("headers", ()), config.max_body_bytes)
    except ClientGone:
        return None
    except LlmgwError as exc:
        status = status_of(exc)
        await reply(
            send,
            status,
            unauthorized_body()
            if status == 401
            else error_body(exc.message, status=status, param=exc.field),
        )
        return None
    model = (
        await asyncio.to_thread(_model_of, body)
        if len(body) > OFFLOAD_BODY_BYTES
        else _model_of(body)
    )
    if model is not None:
        await wait_for_adapter_load(engine, model)
    return _replayed(body, receive)


def _model_of(body: bytes) -> str | None:
    try:
        data: Any = parse_json_body(body)
    except LlmgwError:
        return None  # the route reports the body's problem
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def _replayed(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the body already read, then what the client sends next (its
    disconnect, which the routes watch for)."""
    sent = False

    async def replay() -> MutableMapping[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _path_exists(path: str) -> bool:
    """What vLLM finds on disk for a local path (`get_adapter_absolute_path`: `~` expanded,
    relative to the working directory). The simulator downloads nothing, so a Hugging Face
    repo id that is not a local path does not exist here."""
    return os.path.exists(os.path.expanduser(path))
