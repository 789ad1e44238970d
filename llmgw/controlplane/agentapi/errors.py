"""Refusals of the agent API and their wire form, ``llmgw.protocol.sync.ProtocolErrorBody``.

Agents branch on ``code``; people read ``message``. A message names the rule and the fix and
never echoes a token, credential or anything else the client sent that may be one.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import Response

from llmgw.protocol.sync import MAX_REASON_CHARS, ProtocolErrorBody

__all__ = ["AgentApiRefusal", "protocol_error"]


class AgentApiRefusal(Exception):
    """A request the agent API answers with a non-2xx status and a ProtocolErrorBody.

    code                 status
    malformed-json       400  the body is not JSON / not a valid KV delta
    unauthorized         401  credential or bootstrap token missing, wrong, expired, revoked
    conflict             409  node id not the credential's; node name already registered;
                              a tokenizer upload for a shard the node does not run
    body-too-large       413  the body passes the endpoint's cap
    spec-invalid         422  the body breaks the protocol's model
    protocol-version     426  a protocol version this control plane does not speak
    too-many-requests    429  a full KV copy, or a sync naming a node id not held, refused
                              for now (Retry-After)
    database-unavailable 503  the state store is unreachable; retry
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})


def protocol_error(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    merged = dict(headers or {})
    if status == 401:
        merged.setdefault("WWW-Authenticate", "Bearer")
    body = ProtocolErrorBody(
        code=code[:64],
        message=message.encode("utf-8", "backslashreplace").decode()[:MAX_REASON_CHARS],
    )
    return Response(
        content=body.model_dump_json(),
        status_code=status,
        headers=merged,
        media_type="application/json",
    )
