"""The agent API's wire form of an error, ``llmgw.protocol.sync.ProtocolErrorBody``.

A refusal is an error of the tree (``llmgw.errors``), raised where the rule is broken; its type
states its status and code, and ``refusal`` renders it. Agents branch on ``code``; people
read ``message``. A message names the rule and the fix and never echoes a token, credential
or anything else the client sent that may be one.

    raised                    status  code                  when
    MalformedJsonError        400     malformed-json        the body is not JSON / not a valid KV delta
    AuthError                 401     unauthorized          credential or bootstrap token missing,
                                                            wrong, expired, revoked
    ConflictError             409     conflict              node id not the credential's; node name
                                                            already registered; a tokenizer upload
                                                            for a shard the node does not run
    BodyTooLargeError         413     body-too-large        the body passes the endpoint's cap
    SpecError                 422     spec-invalid          the body breaks the protocol's model
    ProtocolVersionError      426     protocol-version      a protocol version not spoken here
    TooManyRequestsError      429     too-many-requests     a full KV copy, or a sync naming a node
                                                            id not held, refused for now
                                                            (Retry-After)
    DatabaseUnavailableError  503     database-unavailable  the state store is unreachable; retry
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import Response

from llmgw.errors import LlmgwError, TooManyRequestsError, retry_after, status_of
from llmgw.protocol.sync import MAX_REASON_CHARS, ProtocolErrorBody

__all__ = ["protocol_error", "refusal"]


def refusal(exc: LlmgwError) -> Response:
    """``exc`` as the agent API answers it: its type's status and code, a ProtocolErrorBody."""
    headers: dict[str, str] = {}
    if isinstance(exc, TooManyRequestsError):
        headers["Retry-After"] = retry_after(exc.retry_after_s)
    return protocol_error(status_of(exc), exc.code, exc.message, headers)


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
