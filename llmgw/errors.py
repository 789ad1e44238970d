"""The errors llmgw raises on purpose, as one small tree.

    LlmgwError                 code "llmgw-error"
     ├── ConfigError           code "config-invalid"     a setting has a value that cannot work
     ├── SpecError             code "spec-invalid"       a profile, shard spec or request body breaks a rule
     ├── PlacementError        code "placement-failed"   no node can take a replica (carries per-node reasons)
     ├── ConflictError         code "conflict"           a unique name is taken, or a version is stale
     ├── NotFoundError         code "not-found"          the named object does not exist
     ├── AuthError             code "unauthorized"       a token or key is missing or wrong
     └── EngineStartError      code "engine-start-failed" an engine process could not be started

Callers catch at the level they mean: "is this the user's fault?" is
``isinstance(err, SpecError)``. Every message names the object, the bad value,
the rule and the fix; ``field`` names the offending input where there is one.
A message that quotes what a client sent quotes it through ``clip``: an error
must never cost more to send than the fix it names (a 4 MB model name once
came back as a 4 MB 404). This module imports nothing of llmgw's, so every
package (the pure ones included) may use it.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "MAX_ECHO_CHARS",
    "AuthError",
    "ConfigError",
    "ConflictError",
    "EngineStartError",
    "LlmgwError",
    "NotFoundError",
    "PlacementError",
    "SpecError",
    "clip",
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

    code = "llmgw-error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # Dotted path of the offending input ("profile.tp", "replicas"), None when no one field is at fault.
        self.field = field


class ConfigError(LlmgwError):
    code = "config-invalid"


class SpecError(LlmgwError):
    code = "spec-invalid"


class PlacementError(LlmgwError):
    code = "placement-failed"

    def __init__(
        self, message: str, *, reasons: dict[str, str] | None = None, field: str | None = None
    ) -> None:
        super().__init__(message, field=field)
        # node name -> why that node could not take the replica: what answers "why is it pending?".
        self.reasons = dict(reasons or {})


class ConflictError(LlmgwError):
    code = "conflict"


class NotFoundError(LlmgwError):
    code = "not-found"


class AuthError(LlmgwError):
    code = "unauthorized"


class EngineStartError(LlmgwError):
    code = "engine-start-failed"
