"""The error tree (``llmgw.errors``): every type states a status and a code, ``status_of`` reads
them along the MRO, and each wire shape renders what the tree states."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from llmgw.controlplane.agentapi.errors import refusal
from llmgw.errors import (
    CODES,
    AuthError,
    ConflictError,
    LlmgwError,
    SpecError,
    TooManyRequestsError,
    status_of,
)
from llmgw.http.errors import code_for_status, render

ROOT = Path(__file__).resolve().parents[1] / "llmgw"
_DEFINES_ERROR = re.compile(r"^class \w+\([^)]*Error\b", re.MULTILINE)


def _tree() -> list[type[LlmgwError]]:
    """Every subclass of LlmgwError in llmgw: the modules that define one are imported first."""
    for path in sorted(ROOT.rglob("*.py")):
        if _DEFINES_ERROR.search(path.read_text()):
            parts = path.relative_to(ROOT.parent).with_suffix("").parts
            importlib.import_module(".".join(p for p in parts if p != "__init__"))
    found: list[type[LlmgwError]] = []
    todo: list[type[LlmgwError]] = [LlmgwError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__.startswith("llmgw.")]


@pytest.mark.parametrize("cls", _tree(), ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_error_type_states_a_status_and_a_code(cls: type[LlmgwError]) -> None:
    assert isinstance(cls.status, int) and 400 <= cls.status <= 599
    assert re.fullmatch(r"[a-z]+(-[a-z]+)*", cls.code), cls.code


def test_status_of_follows_the_mro() -> None:
    class Fenced(ConflictError):  # states nothing: answers as its parent
        pass

    class Malformed(SpecError):
        status = 400

    class Both(Fenced, SpecError):  # the first base in the MRO that states one wins
        pass

    assert status_of(Fenced("x")) == 409 and Fenced.code == "conflict"
    assert status_of(Malformed("x")) == 400 and Malformed.code == "spec-invalid"
    assert status_of(SpecError("x")) == 422
    assert status_of(Both("x")) == 409
    assert status_of(LlmgwError("x")) == 500
    assert status_of(ValueError("x")) == 500  # outside the tree: a bug


def test_the_code_table_is_the_tree() -> None:
    # The admin API's documented table, which clients branch on: unchanged by the tree.
    assert CODES == {
        "malformed-json": 400,
        "unauthorized": 401,
        "not-found": 404,
        "method-not-allowed": 405,
        "conflict": 409,
        "body-too-large": 413,
        "unsupported-media-type": 415,
        "spec-invalid": 422,
        "placement-failed": 422,
        "protocol-version": 426,
        "too-many-requests": 429,
        "internal": 500,
        "config-invalid": 500,
        "database-unavailable": 503,
    }
    bare = {s: code_for_status(s) for s in (400, 401, 404, 405, 409, 413, 415, 422, 500, 503)}
    assert bare == {
        400: "malformed-json",
        401: "unauthorized",
        404: "not-found",
        405: "method-not-allowed",
        409: "conflict",
        413: "body-too-large",
        415: "unsupported-media-type",
        422: "spec-invalid",
        500: "internal",
        503: "database-unavailable",
    }
    assert (code_for_status(418), code_for_status(502)) == ("spec-invalid", "internal")
    assert (code_for_status(426), code_for_status(429)) == ("protocol-version", "too-many-requests")


def test_the_admin_shape_renders_status_code_and_field() -> None:
    r = render(ConflictError("a model with this name already exists", field="name"))
    assert r.status_code == 409
    assert r.body == (
        b'{"error":{"code":"conflict","message":"a model with this name already exists",'
        b'"field":"name"}}'
    )
    assert render(AuthError("no token")).headers["www-authenticate"] == "Bearer"
    assert (
        render(TooManyRequestsError("slow down", retry_after_s=2.1)).headers["retry-after"] == "3"
    )


def test_the_agent_shape_renders_status_code_and_retry_after() -> None:
    r = refusal(TooManyRequestsError("slow down", retry_after_s=2.1))
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert json.loads(r.body) == {"code": "too-many-requests", "message": "slow down"}
    assert refusal(TooManyRequestsError("x", retry_after_s=0.0)).headers["retry-after"] == "1"
    unauthorized = refusal(AuthError("wrong credential"))
    assert unauthorized.status_code == 401
    assert unauthorized.headers["www-authenticate"] == "Bearer"
