"""The errors llmgw raises on purpose, as one tree: each type carries its HTTP status and code.

    LlmgwError                          500  llmgw-error
     ├── ConfigError                    500  config-invalid          a setting has a value that cannot work
     ├── SpecError                      422  spec-invalid            a field breaks a rule; ``field`` names it
     │    ├── MalformedJsonError        400  malformed-json          the body is not JSON (or not UTF-8)
     │    ├── BodyTooLargeError         413  body-too-large          the body is larger than the listener's cap
     │    └── UnsupportedMediaTypeError 415  unsupported-media-type  the body is not sent as application/json
     ├── PlacementError                 422  placement-failed        no node can take a replica (per-node reasons)
     ├── ConflictError                  409  conflict                a name is taken, an object in use, a version stale
     ├── NotFoundError                  404  not-found               no such object, or no such path
     ├── AuthError                      401  unauthorized            a token, key or credential is missing or wrong
     ├── MethodNotAllowedError          405  method-not-allowed      the path exists; ``Allow`` lists its methods
     ├── ProtocolVersionError           426  protocol-version        an agent speaks another protocol version
     ├── TooManyRequestsError           429  too-many-requests       refused for now; ``retry_after_s`` says how long
     ├── DatabaseUnavailableError       503  database-unavailable    the state store is unreachable; retry
     ├── InternalError                  500  internal                a bug: the message carries the request id
     └── EngineStartError               500  engine-start-failed     an engine process could not be started

``code`` is what clients branch on, one per kind of error whatever layer produced it;
``status_of`` is the one place an error becomes an HTTP status. A subclass that states no
status or code of its own answers as its nearest ancestor (``FencedError(ConflictError)`` is
a 409 "conflict"). The wire shapes are rendered elsewhere, each from these two: the admin
API's ``{"error": {"code", "message", "field"}}`` (``llmgw.http.errors``), the agent API's
``ProtocolErrorBody`` (``llmgw.controlplane.agentapi.errors``). OpenAI's shape keeps its own
contract (``llmgw.gateway.errors``): there a body that breaks a rule is a 400 and the codes
are OpenAI's, which the official client maps to its exception classes.

Callers catch at the level they mean: "is this the user's fault?" is
``isinstance(err, SpecError)``. Every message names the object, the bad value,
the rule and the fix; ``field`` names the offending input where there is one.
A message that quotes what a client sent quotes it through ``clip``: an error
must never cost more to send than the fix it names (a 4 MB model name once
came back as a 4 MB 404). This module imports nothing of llmgw's, so every
package (the pure ones included) may use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Final

__all__ = [
    "CODES",
    "MAX_ECHO_CHARS",
    "AuthError",
    "BodyTooLargeError",
    "ConfigError",
    "ConflictError",
    "DatabaseUnavailableError",
    "EngineStartError",
    "InternalError",
    "LlmgwError",
    "MalformedJsonError",
    "MethodNotAllowedError",
    "NotFoundError",
    "PlacementError",
    "ProtocolVersionError",
    "SpecError",
    "TooManyRequestsError",
    "UnsupportedMediaTypeError",
    "clip",
    "retry_after",
    "status_of",
]

# Enough to recognise any name a person typed (model names rarely pass 100 characters),
# small enough that an error about a hostile value stays a small answer.
MAX_ECHO_CHARS: Final = 200


def clip(text: str) -> str:
    """``text`` as an error message may quote it: at most ``MAX_ECHO_CHARS`` characters, the
    cut marked with "…" so a reader knows it is not the whole value."""
    if len(text) <= MAX_ECHO_CHARS:
        return text
    return text[: MAX_ECHO_CHARS - 1] + "…"


class LlmgwError(Exception):
    """Base of every error llmgw raises deliberately."""

    # Class attributes only: an error's kind, not its instance, decides how it answers.
    status: ClassVar[int] = 500
    code: ClassVar[str] = "llmgw-error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # Dotted path of the offending input ("profile.tp", "replicas"), None when no one field is at fault.
        self.field = field


def status_of(exc: BaseException) -> int:
    """The HTTP status ``exc`` answers with: its class's, inherited along the MRO; 500 for an
    exception outside the tree (a bug)."""
    return exc.status if isinstance(exc, LlmgwError) else 500


class ConfigError(LlmgwError):
    code = "config-invalid"


class SpecError(LlmgwError):
    status = 422
    code = "spec-invalid"


class MalformedJsonError(SpecError):
    status = 400
    code = "malformed-json"


class BodyTooLargeError(SpecError):
    status = 413
    code = "body-too-large"


class UnsupportedMediaTypeError(SpecError):
    status = 415
    code = "unsupported-media-type"


class PlacementError(LlmgwError):
    status = 422
    code = "placement-failed"

    def __init__(
        self, message: str, *, reasons: dict[str, str] | None = None, field: str | None = None
    ) -> None:
        super().__init__(message, field=field)
        # node name -> why that node could not take the replica: what answers "why is it pending?".
        self.reasons = dict(reasons or {})


class ConflictError(LlmgwError):
    status = 409
    code = "conflict"


class NotFoundError(LlmgwError):
    status = 404
    code = "not-found"


class AuthError(LlmgwError):
    status = 401
    code = "unauthorized"


class MethodNotAllowedError(LlmgwError):
    status = 405
    code = "method-not-allowed"


class ProtocolVersionError(LlmgwError):
    status = 426
    code = "protocol-version"


class TooManyRequestsError(LlmgwError):
    status = 429
    code = "too-many-requests"

    def __init__(self, message: str, *, retry_after_s: float, field: str | None = None) -> None:
        super().__init__(message, field=field)
        # How long the client should wait before sending again; a wire sends it as a header
        # (``retry_after``).
        self.retry_after_s = retry_after_s


def retry_after(wait_s: float) -> str:
    """A ``Retry-After`` header's value for a wait of ``wait_s``, the one spelling every wire
    sends: whole seconds, rounded up, at least 1 (clients sleep on it, and "0" invites a hot
    retry loop). The 0.999, not a ceiling: a wait a float's noise past a whole second
    (2.0000000001) still says 2."""
    return str(max(1, int(wait_s + 0.999)))


class DatabaseUnavailableError(LlmgwError):
    status = 503
    code = "database-unavailable"


class InternalError(LlmgwError):
    code = "internal"


class EngineStartError(LlmgwError):
    code = "engine-start-failed"


# Every code a client of llmgw's HTTP APIs can meet, and its status: the one table, read off
# the tree (the codes of errors that never leave a process, KVError's among them, are not here).
# Where two codes share a status the first listed is what the bare status stands for
# (``llmgw.http.errors.code_for_status``: 422 is "spec-invalid", 500 "internal").
CODES: Final[Mapping[str, int]] = {
    cls.code: cls.status
    for cls in (
        MalformedJsonError,
        AuthError,
        NotFoundError,
        MethodNotAllowedError,
        ConflictError,
        BodyTooLargeError,
        UnsupportedMediaTypeError,
        SpecError,
        PlacementError,
        ProtocolVersionError,
        TooManyRequestsError,
        InternalError,
        ConfigError,
        DatabaseUnavailableError,
    )
}
