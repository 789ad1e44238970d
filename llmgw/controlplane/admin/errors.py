"""The internal app's exception handlers: every error a route raises leaves in the admin shape.

An error of the tree (``llmgw.errors``) answers with the status and code its type states. What
others raise is first named as the tree's error it is: FastAPI's validation error a
``SpecError`` (``MalformedJsonError`` for a body that is not JSON), a database constraint
violation that slipped past the API's own checks (a race, a direct SQL write) a
``ConflictError`` or ``SpecError`` naming the constraint instead of a 500, a deadlock or
serialization failure a ``ConflictError`` to send again, an unreachable database a
``DatabaseUnavailableError``. Starlette's HTTPException (404, 405) carries a bare status.

``install_error_handlers`` registers them on an app: one line in ``create_app``.

What it must not do: quote Postgres' own message (it can hold a value the client sent, a secret
reference among them): the constraint, column and SQLSTATE are named, never the value.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.orm.exc import StaleDataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from llmgw.errors import (
    ConflictError,
    DatabaseUnavailableError,
    InternalError,
    LlmgwError,
    MalformedJsonError,
    SpecError,
    clip,
)
from llmgw.http.errors import code_for_status, error_body, error_response, render
from llmgw.store.database import RETRYABLE_SQLSTATES, sqlstate_of

__all__ = ["install_error_handlers", "internal_error_body"]

log = structlog.get_logger("llmgw.controlplane")

# Constraint name -> (field, what it means): each a conflict. Anything unlisted is still a 409/422.
_CONSTRAINTS: dict[str, tuple[str, str]] = {
    "uq_models_name": ("name", "a model with this name already exists"),
    "uq_profiles_name": ("name", "a profile with this name already exists"),
    "uq_deployments_name": ("name", "a deployment with this name already exists"),
    "pk_gpu_classes": ("name", "a GPU class with this name already exists"),
    "fk_profiles_model_id_models": ("model", "the model is still used by profiles"),
    "fk_deployments_profile_id_profiles": ("profile", "the profile is used by a deployment"),
    "fk_deployments_model_id_models": ("model", "the model is used by a deployment"),
    "pk_adapters": ("name", "an adapter with this name already exists"),
    # A race with a model's delete: RESTRICT, whichever of the two wrote first.
    "fk_adapters_model_models": (
        "model",
        "the model is used by adapters, or was deleted while the adapter was written",
    ),
}


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error the app's routes raise in the admin shape."""
    app.add_exception_handler(LlmgwError, _on_llmgw_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(IntegrityError, _on_integrity_error)
    app.add_exception_handler(DataError, _on_data_error)
    app.add_exception_handler(StaleDataError, _on_stale)
    # What is left of DBAPIError (OperationalError, InterfaceError): Postgres is unreachable.
    app.add_exception_handler(DBAPIError, _on_db_unavailable)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)


def internal_error_body(request_id: str) -> bytes:
    """The 500 body ``RequestLog`` sends for an unhandled error, in the admin shape."""
    return error_body(
        InternalError.code, f"internal error; report request id {request_id} with the server's log"
    )


async def _on_llmgw_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LlmgwError)
    return render(exc)


async def _on_validation_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request"}
    # Where the value came from is not part of its name: "limit", not "query.limit".
    loc = [str(p) for p in first.get("loc", ())][1:] if first.get("loc") else []
    field = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return render(
            MalformedJsonError(f"the body is not valid JSON: {ctx.get('error', first['msg'])}")
        )
    if first.get("type") == "string_unicode":
        # JSON's "\ud800" escape parses, but the string cannot be stored (nor printed as UTF-8).
        message = (
            f"{clip(field or 'body')}: must be valid Unicode; it holds a lone surrogate (a \\ud800-"
            "\\udfff escape without its pair): send the character itself or its full pair"
        )
    elif first.get("type") == "extra_forbidden":
        message = (
            f"unknown field {clip(field or '')!r}; check its spelling against the API's schema "
            "(GET /openapi.json)"
        )
    else:
        message = f"{clip(field or 'body')}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return render(SpecError(message, field=field))


async def _on_integrity_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, IntegrityError)
    diag = getattr(exc.orig, "diag", None)
    name = getattr(diag, "constraint_name", None) or ""
    sqlstate = sqlstate_of(exc) or ""
    if name in _CONSTRAINTS:
        field, meaning = _CONSTRAINTS[name]
        return render(ConflictError(meaning, field=field))
    if sqlstate == "23514":  # check_violation
        return render(SpecError(f"the database refused the value (rule {name})"))
    return render(
        ConflictError(f"the change conflicts with stored state (constraint {name or sqlstate})")
    )


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path. Probed through the routes' public
    ``matches``: the router's own 405 names only the first partially matching route's."""
    allowed = [
        method
        for method in _METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL
            for route in request.app.router.routes
        )
    ]
    return ", ".join(allowed)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    message = str(exc.detail)
    if exc.status_code == 405:
        headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
        message = (
            f"{request.method} is not allowed on {clip(request.url.path)}; allowed: "
            f"{headers['Allow']}"
        )
    elif exc.status_code == 404:
        message = (
            f"no such path: {clip(request.method)} {clip(request.url.path)} (the API is under "
            "/admin/v1; see /docs)"
        )
    # A bare status, any a route may raise: its code is the tree's for that status.
    return error_response(exc.status_code, code_for_status(exc.status_code), message, None, headers)


async def _on_data_error(_request: Request, exc: Exception) -> Response:
    # SQLSTATE class 22: a value the column cannot hold that slipped past the schema's bounds.
    # Postgres' own message can quote the value (a secret reference among them): name the
    # column and the SQLSTATE only.
    orig = getattr(exc, "orig", None)
    column = getattr(getattr(orig, "diag", None), "column_name", None)
    sqlstate = getattr(orig, "sqlstate", None) or "22000"
    return render(
        SpecError(
            f"the database cannot store a value (SQLSTATE {sqlstate}); check the field's bounds "
            "in GET /openapi.json",
            field=column,
        )
    )


async def _on_stale(_request: Request, _exc: Exception) -> Response:
    return render(
        ConflictError(
            "someone else changed this object while your update was applied; GET it again, "
            "reapply your change and retry",
            field="version",
        )
    )


async def _on_db_unavailable(_request: Request, exc: Exception) -> Response:
    sqlstate = sqlstate_of(exc)
    if sqlstate in RETRYABLE_SQLSTATES:
        # Postgres aborted this transaction so a concurrent one could finish: nothing was written.
        log.warning("database_conflict", sqlstate=sqlstate)
        return render(
            ConflictError(
                "the change raced with another writer (the reconciler, another admin) and was "
                "rolled back; nothing was written: send it again"
            )
        )
    log.error("database_error", error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return render(DatabaseUnavailableError("the state store is unreachable; retry shortly"))
