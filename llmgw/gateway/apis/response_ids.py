"""Response ids that name their replica: affinity for stored responses without shared state.

A Responses engine stores each response in the process that made it (vLLM's
``response_store``), so a follow-up (``previous_response_id``), a ``GET /v1/responses/{id}``
or a ``cancel`` must reach that replica, whichever gateway it enters. The gateway never hands
a client the engine's own id: it wraps it into one that names the replica, signed with a
secret every gateway of the cluster holds, so any of them reads it back with no lookup, no
table and nothing to replicate (issue #38):

    resp_<base64url, unpadded, of:>
        version          1 byte    1
        replica length   1 byte    1..64
        replica          UTF-8     the replica's id (``Endpoint.replica``)
        engine mark      8 bytes   SHA-256 of the engine process's incarnation (boot id, pid,
                                   start time: ``Endpoint.incarnation``), truncated; zeros
                                   where the gateway knew none
        engine id        ASCII     the engine's id, [A-Za-z0-9_-], 1..256 bytes (the rest)
        tag              16 bytes  HMAC-SHA256(secret, domain || scope || all of the above),
                                   truncated

``unwrap`` refuses, with a ``ResponseIdRefused`` (a 404, as the engine answers an unknown id)
whose ``cause`` and message say why, before any engine is asked: an id over ``MAX_ID_CHARS``
(read no further), one without the prefix or not canonical base64url (``malformed``: a
changed character always changes the bytes, even in the last character's unused bits), one
too short for a tag (``truncated``), one whose tag does not match under any of the cluster's
secrets (``forged``: altered, made up, issued by another cluster or to another key, or under a
secret the cluster no longer holds; these cannot be told apart, on purpose), and one signed by
the cluster in a format version this gateway does not read (``unknown_version``: checked after
the tag, so a random string is never taken for a newer gateway's id).

Guarantees: a client cannot make an id that names a replica or an engine id of its choosing
(it would need the secret: forging a 128-bit tag is out of reach), nor turn one id into another
(any change fails the tag); an id from another cluster, or from before a secret was dropped, is
refused. ``scope`` (the shell passes the key's id) binds an id to whoever created it: the same
id under another key is ``forged``, so a leaked id does not open another tenant's stored
response. Rotation: the first secret signs, every secret given verifies, so a new secret is
added first, made the signer, and the old one dropped once its ids no longer matter. Not a
guarantee: secrecy. The payload is signed, not encrypted: a client who decodes the base64 reads
the replica's id and the engine's; neither is a credential.

The engine id's alphabet is checked both ways: the gateway puts it in a URL path
(``/v1/responses/{id}``, through the agent's proxy), where a "/" or ".." would reach another
path. vLLM's ids (``resp_`` and a hex UUID) pass; a client's own ``request_id``, which vLLM
would take as the id, is removed from the body by ``for_engine``, so the engine always picks.

Rewriting: every place an answer carries an engine id becomes the wrapped one
(``rewrite_answer``: a whole answer's ``id`` and ``previous_response_id``; ``rewrite_events``:
each streamed event carrying the response, ``response.created`` to ``response.completed``), and
``for_engine`` turns an incoming body's ``previous_response_id`` back into the engine's,
returning the replica the request must go to.

The engine mark tells a restarted engine from the one that stored the response: vLLM keeps
stored responses in memory, so an engine restarted in place (same replica, new process) holds
none of them, and the gateway answers that cause itself (``EngineRef.restarted``) instead of
sending the follow-up to a process that cannot know it.

What it must NOT do: look anything up, reach an engine, or read the secret from anywhere: the
shell hands it over (one per cluster, at least ``MIN_SECRET_BYTES``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from llmgw.errors import NotFoundError, clip
from llmgw.gateway.apis.chat_parts import Refused, json_type
from llmgw.gateway.apis.sse import (
    RESPONSES_TYPE,
    event_data,
    event_name,
    json_bytes,
    split_events,
    write_event,
)

__all__ = [
    "MAX_ID_CHARS",
    "MIN_SECRET_BYTES",
    "PREFIX",
    "EngineRef",
    "RefusalCause",
    "ResponseIdRefused",
    "ResponseIds",
    "engine_mark",
]

PREFIX: Final = "resp_"
_VERSION: Final = 1
_TAG_BYTES: Final = 16
_MAX_REPLICA_BYTES: Final = 64
_MAX_ENGINE_ID_BYTES: Final = 256
_MARK_BYTES: Final = 8
_NO_MARK: Final = bytes(_MARK_BYTES)
_MAX_PAYLOAD: Final = 2 + _MAX_REPLICA_BYTES + _MARK_BYTES + _MAX_ENGINE_ID_BYTES + _TAG_BYTES
# The longest id wrap can make: unpadded base64 of the longest payload, after the prefix.
MAX_ID_CHARS: Final = len(PREFIX) + (_MAX_PAYLOAD * 4 + 2) // 3
MIN_SECRET_BYTES: Final = 32
_MIN_PAYLOAD: Final = 2 + 1 + _MARK_BYTES + 1 + _TAG_BYTES
# Bound into every tag, so a tag made for anything else under the same secret never passes.
_DOMAIN: Final = b"llmgw/response-id/v1\x00"
_ENGINE_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,256}")
_B64URL: Final = re.compile(r"[A-Za-z0-9_-]+")

_FORGED: Final = (
    "its signature does not match: it was altered, made up, issued by another cluster or to "
    "another API key, or before this cluster's response-id secret changed"
)

RefusalCause = Literal["too_long", "malformed", "truncated", "unknown_version", "forged"]


class ResponseIdRefused(NotFoundError):
    """A response id this cluster did not issue (or not to this key): it names no stored
    response any replica holds, so the answer is the engine's own for an unknown id, a 404.
    ``field`` is where it came: ``response_id`` (the path) or ``previous_response_id``."""

    def __init__(self, cause: RefusalCause, message: str, *, field: str) -> None:
        super().__init__(message, field=field)
        self.cause: RefusalCause = cause


def engine_mark(incarnation: str) -> bytes:
    """The mark of an engine process in the ids it stores (zeros: not known)."""
    if not incarnation:
        return _NO_MARK
    return hashlib.sha256(incarnation.encode("utf-8", "surrogatepass")).digest()[:_MARK_BYTES]


@dataclass(frozen=True, slots=True)
class EngineRef:
    """Where a stored response lives: the replica, the mark of the engine process that stored
    it, and the id that engine gave it."""

    replica: str
    engine_id: str
    mark: bytes = _NO_MARK

    def restarted(self, incarnation: str) -> bool:
        """Whether the replica's engine now runs as another process than the one that stored
        the response (its stored responses gone with the old one). False where either side
        is not known: the engine then answers for itself."""
        if self.mark == _NO_MARK or not incarnation:
            return False
        return not hmac.compare_digest(self.mark, engine_mark(incarnation))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class ResponseIds:
    """Wraps and unwraps response ids under the cluster's secrets (the first signs, every one
    verifies: rotation)."""

    __slots__ = ("_keys",)

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise ValueError("ResponseIds needs the cluster's response-id secret")
        for secret in secrets:
            if len(secret) < MIN_SECRET_BYTES:
                raise ValueError(
                    f"a response-id secret must be at least {MIN_SECRET_BYTES} bytes (it is "
                    f"{len(secret)}): use 32 random bytes, the same on every gateway"
                )
        self._keys: tuple[bytes, ...] = tuple(secrets)

    def use(self, secrets: Sequence[bytes]) -> None:
        """Sign and verify with ``secrets`` from now on (the cluster's, read at start)."""
        self._keys = ResponseIds(secrets)._keys

    def _tag(self, key: bytes, scope: str, payload: bytes) -> bytes:
        scoped = scope.encode("utf-8", "surrogatepass")
        mac = hmac.new(key, _DOMAIN, hashlib.sha256)
        mac.update(len(scoped).to_bytes(4, "big") + scoped + payload)
        return mac.digest()[:_TAG_BYTES]

    def wrap(self, replica: str, engine_id: str, *, scope: str = "", incarnation: str = "") -> str:
        """The id the client is given for ``engine_id``, stored by ``replica``'s engine
        process ``incarnation`` (empty: not known). A
        ``ValueError`` for an id no follow-up could name (the engine's bug, not the client's)."""
        name = replica.encode("utf-8")
        if not 1 <= len(name) <= _MAX_REPLICA_BYTES:
            raise ValueError(f"a replica id must be 1..{_MAX_REPLICA_BYTES} bytes of UTF-8")
        if _ENGINE_ID.fullmatch(engine_id) is None:
            raise ValueError(
                f"the engine's response id {clip(engine_id)!r} cannot be wrapped: it must be "
                f"1..{_MAX_ENGINE_ID_BYTES} characters of A-Z, a-z, 0-9, _ and -"
            )
        payload = (
            bytes((_VERSION, len(name)))
            + name
            + engine_mark(incarnation)
            + engine_id.encode("ascii")
        )
        return PREFIX + _b64(payload + self._tag(self._keys[0], scope, payload))

    def unwrap(self, wrapped: str, *, scope: str = "", field: str = "response_id") -> EngineRef:
        """The replica and engine id ``wrapped`` names; a ``ResponseIdRefused`` for an id
        this cluster did not issue to ``scope``."""
        if len(wrapped) > MAX_ID_CHARS:
            raise ResponseIdRefused(
                "too_long",
                f"the response id in `{field}` is {len(wrapped)} characters, longer than any "
                f"this gateway issues ({MAX_ID_CHARS}); send the id exactly as POST "
                "/v1/responses returned it",
                field=field,
            )
        body = wrapped[len(PREFIX) :]
        raw = None
        if wrapped.startswith(PREFIX) and _B64URL.fullmatch(body) and len(body) % 4 != 1:
            try:
                raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            except (binascii.Error, ValueError):
                raw = None
        # Canonical only: the last character's unused bits would let two ids decode alike.
        if raw is None or _b64(raw) != body:
            raise self._refused("malformed", wrapped, field, "it is not `resp_` and base64url")
        if len(raw) < _MIN_PAYLOAD:
            raise self._refused("truncated", wrapped, field, "it is too short (cut off?)")
        payload, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
        if not any(hmac.compare_digest(self._tag(k, scope, payload), tag) for k in self._keys):
            raise self._refused("forged", wrapped, field, _FORGED)
        if payload[0] != _VERSION:
            why = f"its format version {payload[0]} is not one this gateway reads (a newer gateway "
            raise self._refused("unknown_version", wrapped, field, why + "issued it: upgrade")
        end = 2 + payload[1]
        mark = payload[end : end + _MARK_BYTES]
        try:
            replica = payload[2:end].decode("utf-8")
            engine_id = payload[end + _MARK_BYTES :].decode("ascii")
        except UnicodeDecodeError:
            replica = engine_id = ""
        if not replica or _ENGINE_ID.fullmatch(engine_id) is None:
            # Signed by a secret of ours, yet not what wrap writes: refused all the same.
            raise self._refused("malformed", wrapped, field, "its contents are not an id's")
        return EngineRef(replica, engine_id, mark)

    @staticmethod
    def _refused(cause: RefusalCause, wrapped: str, field: str, why: str) -> ResponseIdRefused:
        return ResponseIdRefused(
            cause,
            f"no stored response has the id {clip(wrapped)!r} (`{field}`): {why}. Send an id "
            "exactly as this cluster's POST /v1/responses returned it, with the same API key",
            field=field,
        )

    # --- ids in bodies and streams -------------------------------------------------------

    def for_engine(self, body: dict[str, Any], *, scope: str = "") -> EngineRef | None:
        """A Responses create body made ready for its engine, in place: its
        ``previous_response_id`` unwrapped to the engine's id (the returned ``EngineRef``
        names the replica the request must go to; None: no previous response, route freely),
        and a client's ``request_id`` removed (vLLM takes it as the stored response's id: a
        client could pick an id, or overwrite another's stored response)."""
        body.pop("request_id", None)
        previous = body.get("previous_response_id")
        if previous is None:
            return None
        if not isinstance(previous, str):
            raise Refused(
                "`previous_response_id` must be a string: the id of an earlier response; got "
                + json_type(previous),
                field="previous_response_id",
            )
        ref = self.unwrap(previous, scope=scope, field="previous_response_id")
        body["previous_response_id"] = ref.engine_id
        return ref

    def rewrite_answer(
        self, raw: bytes, replica: str, *, scope: str = "", incarnation: str = ""
    ) -> bytes:
        """A whole Responses answer (a create's, a retrieve's or a cancel's) with the engine's
        ids wrapped; an answer that is not a JSON object is returned as it came."""
        try:
            answer = _json_object(raw)
        except ValueError:
            return raw
        if answer is None or not self._rewrite(answer, replica, scope, incarnation):
            return raw
        return json_bytes(answer)

    def rewrite_events(
        self, events: bytes, replica: str, *, scope: str = "", incarnation: str = ""
    ) -> bytes:
        """One read's complete events of a Responses stream with the engine's ids wrapped in
        every event carrying the response; the others pass as they came."""
        if _CARRIES_RESPONSE.search(events) is None:
            return events
        out: list[bytes] = []
        for event in split_events(events):
            name = event_name(event, RESPONSES_TYPE)
            data = event_data(event) if name in _WITH_RESPONSE else None
            response = data.get("response") if data is not None else None
            if data is None or not isinstance(response, dict):
                out.append(event + b"\n\n")
            elif self._rewrite(response, replica, scope, incarnation):
                out.append(write_event(name, data, named=event.startswith(b"event:")))
            else:
                out.append(event + b"\n\n")
        return b"".join(out)

    def _rewrite(
        self, response: dict[str, Any], replica: str, scope: str, incarnation: str
    ) -> bool:
        changed = False
        for key in ("id", "previous_response_id"):
            value = response.get(key)
            if isinstance(value, str):
                response[key] = self.wrap(replica, value, scope=scope, incarnation=incarnation)
                changed = True
        return changed


def _json_object(raw: bytes) -> dict[str, Any] | None:
    value = json.loads(raw)
    return value if isinstance(value, dict) else None


# The events that carry the whole response (OpenAI's Responses streaming events), and a quick
# test for any of them in a read (a delta event is passed on without being split).
_WITH_RESPONSE: Final = frozenset(
    {
        b"response.created",
        b"response.queued",
        b"response.in_progress",
        b"response.completed",
        b"response.incomplete",
        b"response.failed",
    }
)
# (An event line, or a data's "type": neither can occur in generated text, which JSON writes
# with its quotes escaped and without raw newlines.)
_CARRIES_RESPONSE: Final = re.compile(
    rb"(?:^|\n)event: response\.(?:created|queued|in_progress|completed|incomplete|failed)\n"
    rb'|"type":\s*"response\.(?:created|queued|in_progress|completed|incomplete|failed)"'
)
