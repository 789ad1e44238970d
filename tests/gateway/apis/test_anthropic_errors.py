"""The gateway's errors in Anthropic's shape: the type each status maps to, the body, the
stream's error event."""

from __future__ import annotations

import json

import pytest

from llmgw.gateway.apis.anthropic_errors import (
    anthropic_error_body,
    anthropic_error_type,
    anthropic_sse_error,
    body_of,
)
from llmgw.gateway.errors import GatewayError, body_too_large


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (402, "billing_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
        (599, "api_error"),
    ],
)
def test_each_status_has_anthropics_type(status: int, kind: str) -> None:
    assert anthropic_error_type(status) == kind


def test_a_gateway_error_keeps_its_message_in_anthropics_shape() -> None:
    error = GatewayError.rate_limited("60 requests per minute", retry_after_s=2.5)
    assert json.loads(body_of(error)) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": error.message},
    }
    assert error.headers() == {"Retry-After": "3"}  # the shell sends the error's own headers
    too_large = body_too_large(1024, "gateway.max_body_bytes")
    assert json.loads(body_of(too_large))["error"]["type"] == "request_too_large"
    assert json.loads(body_of(GatewayError.invalid_key()))["error"]["type"] == (
        "authentication_error"
    )


def test_any_message_makes_a_valid_body() -> None:
    # A lone surrogate (from a quoted name) has no UTF-8 form: escaped, never a crash.
    body = anthropic_error_body(404, "no model 'a\ud800é'")
    assert json.loads(body)["error"]["message"] == "no model 'a\ud800é'"
    body.decode("ascii")


def test_a_failed_stream_ends_with_an_error_event() -> None:
    event = anthropic_sse_error(502, "the replica failed mid-stream")
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    data = json.loads(event.split(b"data: ", 1)[1])
    assert data == {
        "type": "error",
        "error": {"type": "api_error", "message": "the replica failed mid-stream"},
    }
