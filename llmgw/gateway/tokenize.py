"""Tokenizing a request through an engine's /tokenize, for precise routing (bounded).

The tokens must be the ones the engine will cache, so the request's ``tools``,
``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message`` and
``add_special_tokens`` are forwarded as sent. Bounded three ways: a timeout (past it the
request is routed by the approximate tree: a slow tokenizer must never cost more than the cache
hit can save), a cap on calls in flight (over it: skipped, never queued), and the caller skips
short prompts and multimodal ones. The answer read is capped too: a token is at least a byte
of the prompt sent and at most ~8 bytes of JSON, so more than 16 bytes per byte sent (plus
room for the chat template) is not an answer to this request.

What it must NOT do: raise. Every failure is a reason string the caller counts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from llmgw.gateway.pool import read_capped
from llmgw.gateway.routes import Endpoint

__all__ = ["Tokenizer", "tokenize_payload"]

_TEMPLATE_ROOM_BYTES = 64 * 1024
_CHAT_FIELDS = (
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
)


def tokenize_payload(model: str, body: Mapping[str, Any], *, chat: bool) -> dict[str, Any] | None:
    """The /tokenize body for a request; None when it cannot be tokenized this way."""
    if chat:
        out: dict[str, Any] = {"model": model, "messages": body["messages"]}
        for name in _CHAT_FIELDS:
            if body.get(name) is not None:
                out[name] = body[name]
        return out
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return None
    out = {"model": model, "prompt": prompt}
    if body.get("add_special_tokens") is not None:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


class Tokenizer:
    def __init__(self, http: aiohttp.ClientSession, *, timeout_s: float, concurrency: int):
        self._http = http
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._cap = concurrency
        self._busy = 0

    async def tokenize(
        self, ep: Endpoint, payload: Mapping[str, Any], *, timeout_s: float | None = None
    ) -> list[int] | str:
        """The token ids, or why not: "busy", "timeout" or "error". ``timeout_s``: another
        budget than the routing one (a verification off the request path may wait longer)."""
        if self._busy >= self._cap:
            return "busy"
        self._busy += 1
        body = json.dumps(payload, separators=(",", ":")).encode()
        try:
            async with self._http.post(
                f"{ep.url}/tokenize",
                data=body,
                headers={
                    "Authorization": f"Bearer {ep.api_key}",
                    "Content-Type": "application/json",
                },
                timeout=self._timeout
                if timeout_s is None
                else aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                if resp.status != 200:
                    return "error"
                raw = await read_capped(resp, 16 * len(body) + _TEMPLATE_ROOM_BYTES)
                if raw is None:
                    return "error"
                data = json.loads(raw)
            tokens = data.get("tokens") if isinstance(data, dict) else None
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                return "error"
            return tokens
        except TimeoutError:
            return "timeout"
        except (aiohttp.ClientError, ValueError):
            return "error"
        finally:
            self._busy -= 1
