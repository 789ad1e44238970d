"""What an answer used, whatever its family, as the one triple the key's accounting settles:
``Usage(prompt_tokens, completion_tokens, cached_tokens)``.

Each family reports usage in its own shape, and each shape counts the prompt its own way:

    family                      prompt_tokens               completion      cached_tokens
    chat, completions (OpenAI)  prompt_tokens               completion_...  prompt_tokens_
                                                                            details.cached_...
    embeddings, rerank, score   prompt_tokens               0               0
    responses                   input_tokens                output_tokens   input_tokens_
                                                                            details.cached_...
    messages (Anthropic)        input_tokens + cache_read_  output_tokens   cache_read_
                                + cache_creation_input_...                  input_tokens

Anthropic's ``input_tokens`` leaves out the tokens read from or written to the cache (vLLM's
``_build_anthropic_usage`` subtracts both from the prompt, as Anthropic's API defines it), so
the prompt is their sum: the same request costs the same whichever API it came through.
``Usage.as_openai`` writes the triple in the chat shape ``wire.settle`` reads.

A whole answer's usage is found without decoding the answer (``usage_of``: from the last
``"usage":`` key, checked to hold the family's counts; an embeddings answer is mostly floats
the gateway never needs). A stream's is read as the relay passes its events on
(``stream_reader``): a Responses stream's from its terminal event (``response.completed``,
``response.incomplete`` or ``response.failed``, each carrying the whole response); a
Messages stream's input tokens from ``message_start`` and its output tokens (and the final
input counts, where the engine sends them) from ``message_delta``. A reader sees only the
events of one read from the engine, with the signature of ``wire.filter_events``, counts the
events that carry tokens (the settle's fallback when a stream is cut) and notes the first.
Chat and completions streams are ``wire.filter_events``' own.

What it must NOT do: buffer a stream (a reader keeps a few counts between reads, never an
event), change what it reads (usage events are the protocol's own: the client always gets
them), or trust a count it did not check (anything but a non-negative int counts as 0).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from llmgw.gateway.apis.families import ApiName
from llmgw.gateway.apis.sse import (
    MESSAGES_TYPE,
    RESPONSES_TYPE,
    event_data,
    event_name,
    split_events,
)

__all__ = [
    "StreamReader",
    "Tally",
    "Usage",
    "normalise",
    "still_running",
    "stream_reader",
    "usage_of",
]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int  # every token of the prompt, cached ones included
    completion_tokens: int
    cached_tokens: int  # of the prompt, read from the prefix cache

    def as_openai(self) -> dict[str, Any]:
        """The chat shape ``wire.settle`` reads (and a stream's ``StreamState.usage`` holds)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _int(value: object) -> int:
    return value if type(value) is int and value >= 0 else 0


def _details(usage: Mapping[str, Any], key: str) -> int:
    details = usage.get(key)
    return _int(details.get("cached_tokens")) if isinstance(details, Mapping) else 0


def normalise(api: ApiName, usage: Mapping[str, Any]) -> Usage:
    """A usage object of ``api``'s answers as the triple."""
    if api == "responses":
        return Usage(
            _int(usage.get("input_tokens")),
            _int(usage.get("output_tokens")),
            _details(usage, "input_tokens_details"),
        )
    if api == "messages":
        read = _int(usage.get("cache_read_input_tokens"))
        written = _int(usage.get("cache_creation_input_tokens"))
        return Usage(
            _int(usage.get("input_tokens")) + read + written, _int(usage.get("output_tokens")), read
        )
    if api in ("embeddings", "rerank", "score"):
        # Pooling generates nothing; rerank's usage has no completion count at all.
        return Usage(_int(usage.get("prompt_tokens")), 0, 0)
    return Usage(
        _int(usage.get("prompt_tokens")),
        _int(usage.get("completion_tokens")),
        _details(usage, "prompt_tokens_details"),
    )


# The key a family's usage object must hold to be taken for it (a text that itself holds
# `"usage":` cannot match: inside a JSON string the quotes are escaped).
_COUNT_KEY: Final[Mapping[str, str]] = {
    "chat": "prompt_tokens",
    "completions": "prompt_tokens",
    "embeddings": "prompt_tokens",
    "rerank": "prompt_tokens",
    "score": "prompt_tokens",
    "responses": "input_tokens",
    "messages": "input_tokens",
}
_USAGE_KEY: Final = b'"usage":'
_DECODER: Final = json.JSONDecoder()


def usage_of(api: ApiName, raw: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) answer of ``api``, decoding only that object where
    it can: engines write it after the output, so it is found from the end, and a long answer
    is decoded whole only when the key is not where it is expected. None: no usage (a
    count_tokens answer, which is a count and not a use, has none)."""
    key = _COUNT_KEY.get(api)
    if key is None:
        return None
    found = _last_usage(raw, key)
    if found is None:
        try:
            whole = json.loads(raw)
        except ValueError:
            return None
        usage = whole.get("usage") if isinstance(whole, dict) else None
        found = usage if isinstance(usage, dict) else None
    return None if found is None else normalise(api, found)


def still_running(raw: bytes) -> bool:
    """Whether a whole Responses answer is a response still running (``background: true``:
    the engine answers at once, ``queued`` or ``in_progress``, and generates after the
    answer, so the answer carries no usage to settle)."""
    try:
        whole = json.loads(raw)
    except ValueError:
        return False
    return isinstance(whole, dict) and whole.get("status") in ("queued", "in_progress")


def _last_usage(raw: bytes, key: str) -> dict[str, Any] | None:
    at = raw.rfind(_USAGE_KEY)
    if at < 0:
        return None
    try:
        value, _ = _DECODER.raw_decode(raw[at + len(_USAGE_KEY) :].decode("utf-8").lstrip())
    except (UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) and key in value else None


# --- streams -----------------------------------------------------------------------------


class Tally(Protocol):
    """What a stream has carried so far (``wire.StreamState`` is one): its usage in the chat
    shape once known, the events that carried tokens, when the first came."""

    usage: Mapping[str, Any] | None
    chunks: int
    first_at: float | None


class StreamReader(Protocol):
    """Reads one read's complete events (``relay``: cut at the last blank line) into the
    tally and returns them as they came; ``client_usage`` is ignored (these families' usage
    events are their protocol's, never dropped), kept for ``wire.filter_events``' signature."""

    def __call__(
        self, events: bytes, state: Tally, client_usage: bool, clock: Callable[[], float]
    ) -> bytes: ...


def stream_reader(api: ApiName) -> StreamReader:
    """A reader for one stream of ``api`` (a new one per stream: a Messages reader keeps the
    input count of ``message_start`` until ``message_delta``)."""
    if api == "responses":
        return _ResponsesReader()
    if api == "messages":
        return _MessagesReader()
    raise ValueError(f"no stream reader for {api!r}: chat and completions use wire.filter_events")


def _token(state: Tally, clock: Callable[[], float]) -> None:
    state.chunks += 1
    if state.first_at is None:
        state.first_at = clock()


# The events that end a response, each carrying it whole, usage included (null for a failure
# before any was counted).
_TERMINAL: Final = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})


class _ResponsesReader:
    """Every ``*.delta`` event carries generated tokens (text, reasoning, a tool call's
    arguments, a refusal): the count of those is the fallback for a cut stream."""

    __slots__ = ()

    def __call__(
        self, events: bytes, state: Tally, client_usage: bool, clock: Callable[[], float]
    ) -> bytes:
        for event in split_events(events):
            name = event_name(event, RESPONSES_TYPE)
            if name.endswith(b".delta"):
                _token(state, clock)
            elif name in _TERMINAL:
                usage = _last_usage(event, "input_tokens")
                if usage is None:
                    data = event_data(event)
                    response = data.get("response") if data is not None else None
                    found = response.get("usage") if isinstance(response, dict) else None
                    usage = found if isinstance(found, dict) else None
                if usage is not None:
                    state.usage = normalise("responses", usage).as_openai()
        return events


# message_delta's usage is cumulative: its counts replace message_start's, key by key (an
# engine may send only output_tokens there, Anthropic's older form; vLLM sends all four).
_ANTHROPIC_COUNTS: Final = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)


class _MessagesReader:
    """``content_block_delta`` events carry generated tokens; ``message_start`` carries the
    input count, kept until ``message_delta`` settles the usage."""

    __slots__ = ("_start",)

    def __init__(self) -> None:
        self._start: dict[str, Any] = {}

    def __call__(
        self, events: bytes, state: Tally, client_usage: bool, clock: Callable[[], float]
    ) -> bytes:
        for event in split_events(events):
            name = event_name(event, MESSAGES_TYPE)
            if name == b"content_block_delta":
                _token(state, clock)
            elif name == b"message_start":
                data = event_data(event)
                message = data.get("message") if data is not None else None
                usage = message.get("usage") if isinstance(message, dict) else None
                if isinstance(usage, dict):
                    self._start = {k: usage[k] for k in _ANTHROPIC_COUNTS if k in usage}
            elif name == b"message_delta":
                data = event_data(event)
                usage = data.get("usage") if data is not None else None
                if isinstance(usage, dict):
                    merged = {
                        **self._start,
                        **{k: usage[k] for k in _ANTHROPIC_COUNTS if k in usage},
                    }
                    state.usage = normalise("messages", merged).as_openai()
        return events
