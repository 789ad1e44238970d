"""The gateway's one error type, and OpenAI's error shape it leaves in.

Every failure a client of the public listener meets, from key checks to an upstream
that died mid-stream, is a ``GatewayError`` rendered as OpenAI renders errors::

    {"error": {"message": "...", "type": "...", "param": null, "code": "..."}}

so the official ``openai`` client raises the matching exception class with a readable
message. The table below is the contract (status, ``type``, ``code``):

    status  type                    code                  when
    400     invalid_request_error   (varies)              the body breaks a rule; ``param`` names it
    401     authentication_error    invalid_api_key       no key, a wrong, revoked or expired key
    404     invalid_request_error   model_not_found       unknown model, or one the key may not use
    413     invalid_request_error   request_too_large     the body is over the listener's cap
    429     rate_limit_error        rate_limit_exceeded   rpm / tpm / concurrency (Retry-After set)
    429     insufficient_quota      insufficient_quota    the key's token quota for the period
    502     api_error               upstream_error        the replica failed after the retry rule
    502     api_error               engine_error          the engine answered this request 500 (or
                                                          another 5xx of its own): not retryable
    503     api_error               no_ready_replica      nothing ready serves the model now
    503     api_error               model_overloaded      the model's queue is full or the wait too
                                                          long (Retry-After: the queue's drain time)
    503     api_error               adapter_loading       a runtime LoRA adapter was still being
                                                          placed or loaded when the wait ran out
    503     api_error               adapter_load_failed   its load failed on every replica chosen
                                                          (the engine's reason in the message)
    503     api_error               adapter_unplaceable   no profile of its base model has
                                                          adapter_slots

The table is OpenAI's, not a rendering of ``llmgw.errors``' tree, on purpose: OpenAI answers a
body that breaks a rule with 400 (the tree's ``SpecError`` is the admin API's 422), its codes
are the ones the official client maps to exception classes, and clients of the public listener
must not see it move when the admin API's table does.

What this module must NOT do: echo a secret. Messages are built by the raiser from
names and numbers, never from header values or request bodies; a name the client sent (a
model, a path) is quoted through ``llmgw.errors.clip``, so a 4 MB name is not a 4 MB answer,
and so is an engine's own error message (``engine_error``: the client's own request's
verdict, as an engine's 4xx relayed whole is).
"""

from __future__ import annotations

import json

from llmgw.errors import clip, retry_after
from llmgw.http.errors import printable

__all__ = [
    "GatewayError",
    "bad_request",
    "body_too_large",
    "engine_error",
    "internal_error",
    "method_not_allowed",
    "openai_error_body",
    "sse_error_event",
    "unknown_url",
    "upstream_failed",
]


def openai_error_body(
    message: str, *, type_: str, code: str | None, param: str | None = None
) -> bytes:
    content = {
        "error": {"message": printable(message), "type": type_, "param": param, "code": code}
    }
    return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def internal_error(request_id: str) -> bytes:
    """The 500 body ``RequestLog`` sends for an unhandled error, in OpenAI's shape."""
    return openai_error_body(
        f"internal error; report request id {request_id}", type_="server_error", code=None
    )


def sse_error_event(message: str, *, type_: str, code: str | None) -> bytes:
    """The event a stream ends with when it fails after its headers went out: the client
    sees an error, never a silently truncated answer."""
    return b"data: " + openai_error_body(message, type_=type_, code=code) + b"\n\n"


class GatewayError(Exception):
    """A client-facing failure; ``retry_after_s`` becomes a ``Retry-After`` header."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str,
        code: str | None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> bytes:
        return openai_error_body(self.message, type_=self.type, code=self.code, param=self.param)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": retry_after(self.retry_after_s)}

    @classmethod
    def invalid_key(cls) -> GatewayError:
        return cls(
            401,
            "invalid API key: send `Authorization: Bearer llmgw_<id>_<secret>` with a key from "
            "`llmgw keys create`",
            type_="authentication_error",
            code="invalid_api_key",
        )

    @classmethod
    def model_not_found(cls, model: str, hint: str = "") -> GatewayError:
        """``hint``: the adapters the name may have meant (``runtime_adapters``), or ""."""
        also = f"; {hint}" if hint else ""
        return cls(
            404,
            f"the model {clip(model)!r} does not exist or this key may not use it{also}; "
            "GET /v1/models lists the models this key can use",
            type_="invalid_request_error",
            code="model_not_found",
            param="model",
        )

    @classmethod
    def rate_limited(cls, what: str, retry_after_s: float) -> GatewayError:
        return cls(
            429,
            f"rate limit exceeded: {what}; retry after the time in Retry-After",
            type_="rate_limit_error",
            code="rate_limit_exceeded",
            retry_after_s=retry_after_s,
        )

    @classmethod
    def insufficient_quota(cls, what: str, retry_after_s: float) -> GatewayError:
        """The key's token quota for its period is spent; ``retry_after_s``: until it resets."""
        return cls(
            429,
            f"quota exceeded: {what}; it resets at the start of the next period (Retry-After), "
            "or an admin can create a key with a larger quota",
            type_="insufficient_quota",
            code="insufficient_quota",
            retry_after_s=retry_after_s,
        )

    @classmethod
    def no_ready_replica(cls, model: str) -> GatewayError:
        return cls(
            503,
            f"no ready replica serves {model!r} right now; retry shortly (`llmgw status` shows "
            "why its replicas are not ready)",
            type_="api_error",
            code="no_ready_replica",
            retry_after_s=1,
        )

    @classmethod
    def overloaded(cls, model: str, why: str, retry_after_s: float) -> GatewayError:
        """503: the gateway sheds the request; ``why`` names the bound (a setting) hit."""
        return cls(
            503,
            f"{model!r} is overloaded: {why}; retry after the time in Retry-After (an admin "
            "can add replicas or raise the setting)",
            type_="api_error",
            code="model_overloaded",
            retry_after_s=retry_after_s,
        )


# --- a request's body, path or method, and the upstream ----------------------------------


def bad_request(
    message: str, *, param: str | None = None, code: str = "invalid_value"
) -> GatewayError:
    """400: the body breaks a rule; ``param`` names the field."""
    return GatewayError(400, message, type_="invalid_request_error", code=code, param=param)


def body_too_large(cap_bytes: int, setting: str) -> GatewayError:
    return GatewayError(
        413,
        f"the request body is over {cap_bytes} bytes, the most this gateway reads "
        f"(setting {setting}); send a shorter prompt",
        type_="invalid_request_error",
        code="request_too_large",
    )


def upstream_failed(model: str, why: str) -> GatewayError:
    """502: the replica failed after the retry rule; ``why`` is built from names and numbers."""
    return GatewayError(
        502,
        f"the replica serving {model!r} failed: {why}; retry the request",
        type_="api_error",
        code="upstream_error",
    )


def adapter_not_loaded(adapter: str, base: str) -> GatewayError:
    """503: every replica the route table said holds the runtime adapter answered that it does
    not (an unload since the table was read, or a load not done): the leader and the agents
    converge within seconds."""
    return GatewayError(
        503,
        f"adapter {adapter!r} is being moved between replicas of model {base!r}; retry after "
        f"the time in Retry-After (`llmgw get adapters {adapter}` shows where it is placed)",
        type_="api_error",
        code="adapter_loading",
        retry_after_s=2.0,
    )


def engine_error(model: str, status: int, said: str) -> GatewayError:
    """502: the replica's engine was reached and answered this request with a 5xx of its own
    (``said``: its error message, "" for none). Deterministic as often as not (a request its
    chat template cannot render), so the client is told what the engine said, not to retry:
    a blind retry loop on such a request only repeats the failure."""
    what = f": {clip(said)}" if said else " without a message"
    return GatewayError(
        502,
        f"the engine serving {model!r} failed on this request (it answered {status}{what}); "
        "sending the same request again will most likely fail the same way: check it against "
        "the model's chat template and parameters, or report it to the operator with the time",
        type_="api_error",
        code="engine_error",
    )


def unknown_url(method: str, path: str) -> GatewayError:
    return GatewayError(
        404,
        f"no such path: {clip(method)} {clip(path)} (this listener serves the OpenAI API: "
        "GET /v1/models, POST /v1/completions, POST /v1/chat/completions)",
        type_="invalid_request_error",
        code="unknown_url",
    )


def method_not_allowed(method: str, path: str, allowed: str) -> GatewayError:
    return GatewayError(
        405,
        f"{clip(method)} is not allowed on {clip(path)}; allowed: {allowed}",
        type_="invalid_request_error",
        code="method_not_allowed",
    )
