"""What every admin router shares: authentication, the per-request transaction, pages,
names in paths, and audited create / update / delete.

A route does three things: parse (pydantic), call the SQL of ``llmgw.store``
(``catalog``, ``fleet``, ...), and hand its write to ``create`` / ``update`` / ``delete``
here, which record the audit row and NOTIFY the reconciler inside the same transaction.
Keeping that in one place is what makes "every write is audited and wakes the reconciler"
true of routes written later too. Nothing here may commit: the ``Session`` dependency owns
the transaction and commits before the response is sent.
"""

from __future__ import annotations

import base64
import binascii
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.convertors import PathConvertor, register_url_convertor

from llmgw.controlplane.admin.schemas import ErrorBody, Page, segment_problem
from llmgw.errors import AuthError, NotFoundError, SpecError, clip
from llmgw.http.admin_auth import admin_token_problem
from llmgw.store import catalog

__all__ = [
    "DEFAULT_PAGE",
    "ERRORS",
    "MAX_PAGE",
    "Actor",
    "Audit",
    "AuditOf",
    "Cursor",
    "Limit",
    "Session",
    "add_read_routes",
    "audit_view",
    "create",
    "decode_cursor",
    "delete",
    "page",
    "path_name",
    "require_admin",
    "stored_path_name",
    "update",
]

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 415, 422)
}
DEFAULT_PAGE = 100
MAX_PAGE = 1000
_CURSOR_PREFIX = b"after:"

_bearer = HTTPBearer(auto_error=False)


def require_admin(
    request: Request,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The admin token again, behind ``AdminAuth``: a router mounted without that
    middleware is still never open."""
    header = None if creds is None else f"{creds.scheme} {creds.credentials}"
    problem = admin_token_problem(header, request.app.state.admin_token)
    if problem is not None:
        raise AuthError(problem)
    return "admin"


async def _session(request: Request) -> AsyncIterator[AsyncSession]:
    factory: async_sessionmaker[AsyncSession] = request.app.state.sessions
    async with factory() as session, session.begin():
        yield session


Actor = Annotated[str, Depends(require_admin)]
# scope="function": the transaction commits before the response is sent, so a client that
# got 201 can read its write, and a failed commit is an error reply, never a "done".
Session = Annotated[AsyncSession, Depends(_session, scope="function")]


@dataclass(frozen=True, slots=True)
class Audit:
    """Who writes, for the audit row: the actor and the request id that ties the row to
    the access log line."""

    actor: str
    request_id: str

    async def record(
        self,
        session: AsyncSession,
        *,
        action: str,
        kind: str,
        name: str,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
    ) -> None:
        await catalog.record_audit(
            session,
            actor=self.actor,
            action=action,
            kind=kind,
            name=name,
            before=before,
            after=after,
            request_id=self.request_id,
        )


def _audit_of(request: Request, actor: Actor) -> Audit:
    return Audit(actor=actor, request_id=str(getattr(request.state, "request_id", "")))


AuditOf = Annotated[Audit, Depends(_audit_of)]


def audit_view(out: BaseModel) -> dict[str, Any]:
    """What the audit row keeps of an object: its API view (secrets are already out of
    it), less the timestamps the row has itself and what others write (a node's inventory,
    a deployment's status)."""
    return dict(
        out.model_dump(mode="json", exclude={"created_at", "updated_at", "status", "inventory"})
    )


def path_name(kind: str, name: str, plural: str | None = None) -> str:
    """``name`` from the URL, refused when its slashes make it unaddressable (the pattern is
    not checked: a node named before names had one rule must still be reachable)."""
    problem = segment_problem(name)
    if problem is not None:
        raise NotFoundError(
            f"no {kind} can be named {clip(name)!r}: {problem}; list them with "
            f"GET /admin/v1/{plural or kind + 's'}",
            field="name",
        )
    return name


class _StoredNameConvertor(PathConvertor):
    """``{name:stored}``: any characters, newlines included. Starlette's ``path`` is ``.*``,
    which stops at a newline, so a node that registered as "a\\nb" (before names had one
    rule) matched no route at all and could never be approved, cordoned or deleted; and
    "a%0A" matched node "a" (``$`` matches before a final newline)."""

    regex = "(?s:.*)"


register_url_convertor("stored", _StoredNameConvertor())


def stored_path_name(kind: str, name: str) -> str:
    """``name`` from the URL of an object that may have been stored before the name rule
    (nodes): looked up as it is, whatever it holds, so it stays manageable; only a NUL,
    which Postgres cannot store, is not found without asking."""
    if not name or "\x00" in name:
        raise NotFoundError(
            f"no {kind} is named {clip(name)!r}; list them with GET /admin/v1/{kind}s",
            field="name",
        )
    return name


# --- writes -----------------------------------------------------------------

_Row = TypeVar("_Row")
_Out = TypeVar("_Out", bound=BaseModel)
View = Callable[[_Row], Awaitable[_Out]]


async def create(
    session: AsyncSession, audit: Audit, *, kind: str, name: str, row: _Row, view: View[_Row, _Out]
) -> _Out:
    """Insert ``row``, audit it, return its view (server defaults read back)."""
    await catalog.insert_row(session, row)
    out = await view(row)
    await audit.record(
        session, action="create", kind=kind, name=name, before=None, after=audit_view(out)
    )
    return out


async def update(
    session: AsyncSession,
    audit: Audit,
    *,
    kind: str,
    name: str,
    row: Any,
    changes: dict[str, Any],
    version: int | None,
    view: View[Any, _Out],
    action: str = "update",
    on_change: Callable[[Any], Awaitable[None]] | None = None,
) -> tuple[_Out, bool]:
    """Apply ``changes`` to ``row`` (locked FOR UPDATE by the caller); audit only a real
    change, so a retried or repeated request writes nothing. Returns the view and whether
    anything changed. ``on_change`` runs before the UPDATE is flushed (a generation bump)."""
    before = await view(row)
    if not catalog.apply_changes(row, changes, version=version, kind=kind):
        return before, False
    if on_change is not None:
        await on_change(row)
    await catalog.save_row(session, row)
    out = await view(row)
    await audit.record(
        session,
        action=action,
        kind=kind,
        name=name,
        before=audit_view(before),
        after=audit_view(out),
    )
    return out, True


async def delete(
    session: AsyncSession,
    audit: Audit,
    *,
    kind: str,
    name: str,
    before: dict[str, Any],
    remove: Callable[[], Awaitable[object]],
) -> None:
    """Run ``remove`` (the SQL that refuses or deletes) and audit what was there."""
    await remove()
    await audit.record(session, action="delete", kind=kind, name=name, before=before, after=None)


# --- pages ------------------------------------------------------------------

Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"Page size, at most {MAX_PAGE}.")]
Cursor = Annotated[
    str | None,
    Query(max_length=1024, description="`next_cursor` of the previous page; absent: the first."),
]


def decode_cursor(cursor: str | None) -> str | None:
    """The key the previous page ended at; SpecError for anything this API did not hand out."""
    if cursor is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        after = raw.removeprefix(_CURSOR_PREFIX).decode("utf-8")
        ok = raw.startswith(_CURSOR_PREFIX) and "\x00" not in after
    except (binascii.Error, ValueError):
        ok = False
    if not ok:
        raise SpecError(
            "cursor is not one this API handed out; pass `next_cursor` of the previous page "
            "unchanged, or leave it out to start from the first page",
            field="cursor",
        )
    return after


def page(
    rows: Sequence[Any], limit: int, key_of: Callable[[Any], str], items: Sequence[_Out]
) -> Page[_Out]:
    """``rows`` was read with ``limit + 1``: one more than fits says another page exists.
    ``items`` are the views of the first ``limit`` rows."""
    next_cursor = None
    if len(rows) > limit:
        raw = _CURSOR_PREFIX + key_of(rows[limit - 1]).encode("utf-8")
        next_cursor = base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")
    return Page[_Out](items=list(items[:limit]), next_cursor=next_cursor)


def add_read_routes(
    router: APIRouter,
    *,
    plural: str,
    out: type[_Out],
    list_page: Callable[[AsyncSession, str | None, int], Awaitable[Page[_Out]]],
    get_one: Callable[[AsyncSession, str], Awaitable[_Out]],
    key: str = "name",
    convertor: str = "path",
) -> None:
    """``GET /{plural}`` (a page, keyset on ``key``), ``GET /{plural}/`` (the same: a
    trailing slash lists rather than naming the empty object) and ``GET /{plural}/{key}``
    (names may hold slashes)."""

    async def list_items(
        session: Session, limit: Limit = DEFAULT_PAGE, cursor: Cursor = None
    ) -> Page[_Out]:
        return await list_page(session, decode_cursor(cursor), limit)

    async def get_item(session: AsyncSession, **path: str) -> _Out:
        return await get_one(session, path[key])

    # The path parameter is called what the resource is keyed by ("name", "id"), in the URL
    # and in the OpenAPI document alike.
    get_item.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(
                "session", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Session
            ),
            inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, annotation=str),
        ],
        return_annotation=out,
    )
    list_items.__name__ = f"list_{plural.replace('-', '_')}"
    get_item.__name__ = f"get_{plural.replace('-', '_')}"
    router.get(f"/{plural}", response_model=Page[out], tags=[plural])(list_items)  # type: ignore[valid-type]
    router.get(f"/{plural}/", response_model=Page[out], include_in_schema=False)(list_items)  # type: ignore[valid-type]
    router.get(
        f"/{plural}/{{{key}:{convertor}}}",
        response_model=out,
        tags=[plural],
        summary=f"Get one of {plural} by {key}",
    )(get_item)
