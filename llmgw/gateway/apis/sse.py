"""Server-sent events as the Responses and Messages streams carry them, one read's worth at a
time: split into events, named, their data decoded, written back.

Engines write each of these events as ``event: <name>`` then ``data: <one JSON object>`` and a
blank line (vLLM's ``_convert_stream_to_sse_events`` and ``wrap_data_with_event``); the relay
hands over only complete events (``relay``: a read cut at its last blank line). An event
without an ``event:`` line is named by its data's ``type``, which both APIs also write.

What it must NOT do: hold an event past the call that was given it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

__all__ = [
    "MESSAGES_TYPE",
    "RESPONSES_TYPE",
    "event_data",
    "event_name",
    "json_bytes",
    "split_events",
    "write_event",
]

_EVENT_LINE: Final = b"event: "
# Each family's event names, found in an event's data when it has no event line: a Responses
# event's type is "response." and dotted words (no item or part type starts so), a Messages
# event's one of Anthropic's stream events (no content block type is named so).
RESPONSES_TYPE: Final = re.compile(rb'"type":\s*"(response\.[a-z_.]+)"')
MESSAGES_TYPE: Final = re.compile(
    rb'"type":\s*"(message_start|message_delta|message_stop|content_block_start|'
    rb'content_block_delta|content_block_stop|ping|error)"'
)


def split_events(events: bytes) -> list[bytes]:
    """The events of one read (each without its blank line; empty ones dropped)."""
    return [e for e in events.split(b"\n\n") if e.strip()]


def event_name(event: bytes, by_type: re.Pattern[bytes]) -> bytes:
    """The event's name: its ``event:`` line, else group 1 of ``by_type`` searched in it (a
    pattern for the family's own names: a quote inside a JSON string is escaped, so no
    generated text matches one)."""
    if event.startswith(_EVENT_LINE):
        end = event.find(b"\n")
        return event[len(_EVENT_LINE) : end if end >= 0 else len(event)].strip()
    m = by_type.search(event)
    return m.group(1) if m else b""


def event_data(event: bytes) -> dict[str, Any] | None:
    """The event's data as one JSON object, None when it is not one. SSE lets data span
    lines: their payloads are joined with a newline, as a client joins them."""
    lines = [ln[5:].removeprefix(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
    try:
        value = json.loads(b"\n".join(lines))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def write_event(name: bytes, data: dict[str, Any], *, named: bool) -> bytes:
    """An event as the engine writes it (``named``: with its ``event:`` line)."""
    return (_EVENT_LINE + name + b"\n" if named else b"") + b"data: " + json_bytes(data) + b"\n\n"


def json_bytes(value: object) -> bytes:
    """``value`` as compact UTF-8 JSON. A lone surrogate (JSON's ``"\\ud800"`` decodes to one)
    has no UTF-8 form: it is written back as the same escape, so the text round-trips instead
    of raising."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")
