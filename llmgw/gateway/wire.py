"""The wire side of the gateway's request path, pure of routing: reading what a request asks
(prompt text for routing, tokens to reserve, whether the client wants a stream's usage),
settling what an answer used, and passing an engine's server-sent events through while
counting them and capturing their usage.

What it must NOT do: buffer a stream (``filter_events`` sees only the events of one read from
the engine and returns them at once), or trust numbers it did not check (usage fields that are
not non-negative ints count as 0).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.types import Receive, Scope, Send

from llmgw.config import GatewaySettings
from llmgw.gateway.errors import bad_request

__all__ = [
    "MAX_TOKEN_ID",
    "Prompt",
    "Settleable",
    "StreamState",
    "ask_for_usage",
    "filter_events",
    "header",
    "prompt_of",
    "reserve_tokens",
    "send_json",
    "settle",
    "usage_of",
    "wait_disconnect",
]

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) legacy completions default
# The largest token id a prompt may carry: engines hold ids in 32-bit tensors (no vocabulary
# comes near), and the router packs them into 64-bit words (``router.token_home_key``), which
# an id of 2**63 or more overflowed: a 500 and an error-level traceback.
MAX_TOKEN_ID = 2**31 - 1
_JSON = (b"content-type", b"application/json")


class Settleable(Protocol):
    """What the request path does with an admitted request (``limits.AdmittedRequest``):
    settle it with what the answer used, release it when the request ends."""

    def settle(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None: ...
    def release(self) -> None: ...


@dataclass(slots=True)
class StreamState:
    """What a stream has carried so far (settled from it on any end)."""

    usage: Mapping[str, Any] | None = None
    chunks: int = 0
    first_at: float | None = None


@dataclass(slots=True)
class Prompt:
    text: str
    multimodal: bool
    token_ids: list[int] | None = None  # given by the client (completions with token ids)


# A usage *object*. Engines may write `"usage":null` into every chunk of a stream that asked
# for usage (OpenAI's own API does), and decoding each of those to find the one that matters
# cost more than the rest of the relay. Inside a JSON string the quotes are escaped, so no
# generated text can match.
_USAGE_OBJECT = re.compile(rb'"usage":\s*\{')
# A chunk that carries a token: text, a tool call or a finish. The simulator (and some
# engines) send a role-only chunk as soon as a request is accepted, before its prefill; that
# one is not a first token, and the router counts a prefill done at the first token.
_TOKEN = re.compile(
    rb'"(?:content|text|reasoning_content)":\s*"[^"]|"tool_calls":\s*\[\s*\{|"finish_reason":\s*"'
)


def filter_events(
    events: bytes, state: StreamState, client_usage: bool, clock: Callable[[], float]
) -> bytes:
    """Count content chunks, note when the first token came, capture the usage chunk and
    drop it when not asked for."""
    if _USAGE_OBJECT.search(events) is None:
        n = events.count(b"data: {")
        if n and state.first_at is None and _TOKEN.search(events) is not None:
            state.first_at = clock()
        state.chunks += n
        return events
    kept: list[bytes] = []
    for event in events.split(b"\n\n"):
        if not event:
            continue
        if event.startswith(b"data: {") and _USAGE_OBJECT.search(event) is not None:
            try:
                obj = json.loads(event[6:])
            except ValueError:
                obj = None
            if isinstance(obj, dict) and obj.get("usage") and not obj.get("choices"):
                state.usage = obj["usage"]
                if client_usage:
                    kept.append(event)
                continue
        if event.startswith(b"data: {"):
            if state.first_at is None and _TOKEN.search(event) is not None:
                state.first_at = clock()
            state.chunks += 1
        kept.append(event)
    return b"".join(e + b"\n\n" for e in kept)


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


_USAGE_KEY = b'"usage":'
_DECODER = json.JSONDecoder()


def usage_of(raw: bytes) -> Mapping[str, Any] | None:
    """The ``usage`` object of a whole (non-streamed) answer, decoding only that object.

    Engines put it last, so it is found from the end: a long completion's text is never
    decoded on the gateway's hot path. Falls back to decoding the whole answer when the key
    is not where it is expected (a text that itself contains the key is caught by the check
    that what follows decodes to an object holding token counts)."""
    at = raw.rfind(_USAGE_KEY)
    if at >= 0:
        try:
            text = raw[at + len(_USAGE_KEY) :].decode("utf-8")
            value, _ = _DECODER.raw_decode(text.lstrip())
        except (UnicodeDecodeError, ValueError):
            value = None
        if isinstance(value, dict) and "prompt_tokens" in value:
            return value
    try:
        whole = json.loads(raw)
    except ValueError:
        return None
    usage = whole.get("usage") if isinstance(whole, dict) else None
    return usage if isinstance(usage, dict) else None


def settle(
    admission: Settleable,
    usage: Mapping[str, Any] | None,
    *,
    completion_fallback: int,
    prompt_fallback: int,
) -> None:
    if isinstance(usage, Mapping):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else 0
        admission.settle(
            prompt_tokens=_int(usage.get("prompt_tokens")),
            completion_tokens=_int(usage.get("completion_tokens")),
            cached_tokens=_int(cached),
        )
    else:
        admission.settle(
            prompt_tokens=prompt_fallback if completion_fallback else 0,
            completion_tokens=completion_fallback,
            cached_tokens=0,
        )


def _int(value: object) -> int:
    return value if type(value) is int and value >= 0 else 0


def reserve_tokens(
    body: Mapping[str, Any],
    chat: bool,
    settings: GatewaySettings,
    *,
    context_limit: int | None = None,
    prompt_tokens: int = 0,
) -> int:
    """Completion tokens to reserve: what the engine may generate, read as vLLM's
    ``get_max_tokens`` reads it (``max_completion_tokens or max_tokens``, on either path; a
    completion that does not send ``max_tokens`` has OpenAI's and vLLM's default of 16, one
    that sends null has none), else, with no limit, the model's context length
    (``context_limit``, from the replicas' /v1/models) less the prompt, or
    ``gateway.default_max_tokens`` while that is not known; times the sequences it generates
    (``n``, or ``best_of`` when larger). The body's fields are the engine's values already
    (``engine_fields.canonicalize``): ``"250"`` is 250 here as there."""
    default = None if chat else _COMPLETIONS_DEFAULT_MAX_TOKENS
    # Canonical already: each an int within its bound, or None.
    wanted = body.get("max_completion_tokens") or body.get("max_tokens", default)
    if wanted is None:
        if context_limit is not None:
            wanted = max(1, context_limit - prompt_tokens)
        else:
            wanted = settings.default_max_tokens
    copies = max(1, body.get("n") or 1, body.get("best_of") or 1)
    return int(wanted) * copies


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make a streamed request ask the engine for its usage (``stream_options.include_usage``:
    the gateway settles from it); whether the client asked for it too (else the relay drops
    the usage chunk)."""
    opts = body.get("stream_options")
    opts = dict(opts) if isinstance(opts, dict) else {}
    client_usage = bool(opts.get("include_usage"))
    opts["include_usage"] = True
    body["stream_options"] = opts
    return client_usage


def prompt_of(body: Mapping[str, Any], *, chat: bool) -> Prompt:
    """What the request asks the engine to read, for routing: a chat's messages as one text,
    a completion's prompt or its token ids. A 400 for a shape no engine serves: a message
    without a string ``role`` or with content that is not a string, a list of parts or null
    (vLLM's pydantic refuses those too; the simulator's template raised on them, a 500 the
    gateway relayed as a 502 to retry), token ids outside ``0..MAX_TOKEN_ID``."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("`messages` must be a non-empty list", param="messages")
        parts: list[str] = []
        multimodal = False
        tools = body.get("tools")
        if tools:
            parts.append(json.dumps(tools, sort_keys=True, separators=(",", ":")))
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise bad_request("each message must be an object", param="messages")
            role = m.get("role")
            if not isinstance(role, str) or not role:
                # Any string: vLLM takes roles its templates know beyond OpenAI's (Llama's
                # "ipython"), and a template that refuses one is a 400 from the engine.
                raise bad_request(
                    f"messages[{i}].role must be a non-empty string: system, user, assistant, "
                    "tool or developer (or another role the model's chat template knows)",
                    param=f"messages[{i}].role",
                )
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for p in content:
                    if isinstance(p, dict) and p.get("type") == "text":
                        texts.append(str(p.get("text", "")))
                    else:
                        multimodal = True
                content = "".join(texts)
            elif content is not None and not isinstance(content, str):
                raise bad_request(
                    f"messages[{i}].content must be a string, a list of content parts or null",
                    param=f"messages[{i}].content",
                )
            parts.append(f"\x00{role}\x01{content if content is not None else ''}")
        return Prompt("".join(parts), multimodal)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return Prompt(prompt, False)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if min(prompt) < 0 or max(prompt) > MAX_TOKEN_ID:
            at = next(i for i, t in enumerate(prompt) if not 0 <= t <= MAX_TOKEN_ID)
            raise bad_request(
                f"`prompt` token ids must be in 0..{MAX_TOKEN_ID} (ids from the model's "
                f"tokenizer, such as its /tokenize gives); prompt[{at}] is not",
                param="prompt",
            )
        return Prompt(" ".join(map(str, prompt)), False, token_ids=list(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, str) for t in prompt):
        # A batch: routed by its first prompt (the others mostly share its prefix or not at all).
        return Prompt(prompt[0], False)
    raise bad_request(
        "`prompt` must be a string, a list of strings or of token ids", param="prompt"
    )


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            try:
                return str(value.decode("latin-1"))
            except UnicodeDecodeError:
                return None
    return None


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})
