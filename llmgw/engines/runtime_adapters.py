"""How an engine loads and unloads LoRA adapters while it runs, and how to read its answers.

The agent converges a running engine's adapters to the set the leader placed on it (issue
[lora]; llmgw/nodeagent/adapter_sync.py) without restarting it. What differs between engines
is only the HTTP: the routes, the body's field names, what success looks like, and which
errors mean the call was already done. Those live here, one `RuntimeAdapterApi` per engine
family (``Engine.runtime_adapters``); the agent's shell knows no engine by name.

Idempotence is the point of `load_answer`/`unload_answer`: the agent may crash between a call
and its record of the answer, and after an adoption it asks again. So a load answered "already
loaded" and an unload answered "not loaded" are not failures (``already``, ``absent``), and
the agent re-reads the engine's list (``list_path``, ``listed``) to learn what it really holds.

Verified against the engines' code:

- vLLM 0.32 (``vllm/entrypoints/serve/lora/api_router.py``,
  ``vllm/entrypoints/openai/models/serving.py``), served only with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true: ``POST /v1/load_lora_adapter {"lora_name",
  "lora_path"}`` answers 200 with the bare text ``Success: LoRA adapter '<n>' added
  successfully.``; a name already loaded is a 400 "... has already been loaded. If you want to
  load the adapter in place, ..."; a path with no adapter a 404 "Loading lora <n> failed: No
  adapter found for <path>"; any other failure a 500 with the engine's message.
  ``POST /v1/unload_lora_adapter {"lora_name"}`` answers 200, or 404 "The lora adapter '<n>'
  cannot be found.". Errors are ``{"error": {"message", ...}}``. ``GET /v1/models`` lists
  every adapter (static and runtime) as a card with ``parent`` (the base model) and ``root``
  (its path); the base model's card has no parent. The simulator serves the same routes and
  answers (llmgw/simengine/lora_routes.py).
- SGLang (``python/sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``,
  ``lora/lora_registry.py``): ``POST /load_lora_adapter`` and ``/unload_lora_adapter`` with
  the same field names, answering ``{"success", "error_message", "loaded_adapters"}``, 200 on
  success and 400 otherwise. A name already registered is "LoRA with name <n> already
  exists"; an unknown one on unload "LoRA with name <n> does not exist". The routes are
  ``ADMIN_OPTIONAL``: the API key is enough while no ``--admin-api-key`` is set (llmgw sets
  none). ``/v1/models`` lists adapters as vLLM does (``root`` the path, ``parent`` the
  served model).

This module must NOT do I/O: the shell makes the calls and hands the status and text in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "ADAPTERS_PER_BATCH",
    "SGLANG_RUNTIME_ADAPTERS",
    "VLLM_RUNTIME_ADAPTERS",
    "AdapterAnswer",
    "AdapterOutcome",
    "EngineCall",
    "RuntimeAdapterApi",
]

# Adapters one batch may mix (vLLM's --max-loras, SGLang's --max-loras-per-batch) when the
# profile's args say nothing: each is a slot of GPU memory reserved at start, so a profile
# with many adapter slots does not reserve GPU room for all of them in every batch.
ADAPTERS_PER_BATCH: Final = 4
# What one reason quotes of an engine's answer at most: the binding's reason has its own cap.
_MAX_REASON_CHARS: Final = 512

# ok: done; already: the load found the adapter loaded (by whom, the agent learns from the
# engine's list); absent: the unload found nothing to unload; failed: anything else.
AdapterOutcome = Literal["ok", "already", "absent", "failed"]


@dataclass(frozen=True, slots=True)
class AdapterAnswer:
    outcome: AdapterOutcome
    # The engine's own words for anything but ok, clipped: what the binding reports.
    reason: str = ""


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One POST to the engine's HTTP port, a JSON body, the shard's API key as Bearer."""

    path: str
    body: dict[str, str]


@dataclass(frozen=True, slots=True)
class RuntimeAdapterApi:
    """An engine's runtime LoRA routes and how its answers read."""

    load_path: str
    unload_path: str
    # Lists every adapter the engine serves (OpenAI's model list with vLLM's `parent` and
    # `root`): what an adopting agent converges from.
    list_path: str = "/v1/models"
    name_field: str = "lora_name"
    path_field: str = "lora_path"
    # Lowercase phrases of an error answer meaning the load was already done, the unload
    # already done (or never needed).
    already_loaded: tuple[str, ...] = ()
    not_loaded: tuple[str, ...] = ()
    # The JSON field that says whether the call succeeded when the status alone does not
    # (SGLang's "success"); empty: the status says it.
    success_field: str = ""

    def load(self, name: str, path: str) -> EngineCall:
        return EngineCall(self.load_path, {self.name_field: name, self.path_field: path})

    def unload(self, name: str) -> EngineCall:
        return EngineCall(self.unload_path, {self.name_field: name})

    def load_answer(self, status: int, text: str) -> AdapterAnswer:
        return self._answer(status, text, self.already_loaded, "already")

    def unload_answer(self, status: int, text: str) -> AdapterAnswer:
        return self._answer(status, text, self.not_loaded, "absent")

    def _answer(
        self,
        status: int,
        text: str,
        done_phrases: tuple[str, ...],
        done: Literal["already", "absent"],
    ) -> AdapterAnswer:
        data = _json(text)
        succeeded = 200 <= status < 300
        if succeeded and self.success_field and isinstance(data, dict):
            succeeded = data.get(self.success_field) is not False
        if succeeded:
            return AdapterAnswer("ok")
        message = _message(data, text)
        # Only a refusal of the request itself can mean "already done": a 5xx is the engine
        # failing, whatever its message quotes.
        if 400 <= status < 500 or (200 <= status < 300):
            lowered = message.lower()
            if any(p in lowered for p in done_phrases):
                return AdapterAnswer(done, _clip(message))
        return AdapterAnswer("failed", _clip(f"{status}: {message}" if message else str(status)))

    def listed(self, text: str) -> dict[str, str] | None:
        """Every adapter the engine's model list names, with its path ("" when it gives none):
        the cards with a parent. None when the answer is no model list."""
        data = _json(text)
        cards = data.get("data") if isinstance(data, dict) else data
        if not isinstance(cards, list):
            return None
        out: dict[str, str] = {}
        for card in cards:
            if not isinstance(card, dict):
                continue
            name, parent, root = card.get("id"), card.get("parent"), card.get("root")
            if isinstance(name, str) and name and isinstance(parent, str) and parent:
                out[name] = root if isinstance(root, str) else ""
        return out


VLLM_RUNTIME_ADAPTERS = RuntimeAdapterApi(
    load_path="/v1/load_lora_adapter",
    unload_path="/v1/unload_lora_adapter",
    already_loaded=("has already been loaded",),
    not_loaded=("cannot be found",),
)
SGLANG_RUNTIME_ADAPTERS = RuntimeAdapterApi(
    load_path="/load_lora_adapter",
    unload_path="/unload_lora_adapter",
    already_loaded=("already exists", "already loaded"),
    not_loaded=("does not exist", "not loaded", "cannot be found"),
    success_field="success",
)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _message(data: Any, text: str) -> str:
    """The error's message in any of the shapes engines answer with: OpenAI's
    {"error": {"message"}}, vLLM's older {"message"}, SGLang's {"error_message"}, FastAPI's
    {"detail"}; else the text itself."""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        for key in ("error_message", "message", "detail", "error"):
            value = data.get(key)
            if isinstance(value, str) and value:
                return value
    return text.strip()


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 1] + "…"
