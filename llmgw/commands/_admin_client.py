"""How CLI commands reach the admin API: which URL and token, and errors that say what to do.

The connection comes from, strongest first: ``--url`` / ``--admin-token``, then
``LLMGW_ADMIN_URL`` / ``LLMGW_ADMIN_TOKEN``, then the ``up.json`` that ``llmgw up`` writes
in its data dir (``--data-dir``, else the default data dir). So on a machine running
``llmgw up`` the commands need no flags at all.

This module must NOT print: commands decide how to show results and errors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from llmgw.errors import AuthError, ConfigError, ConflictError, LlmgwError, NotFoundError, SpecError

__all__ = [
    "AdminClient",
    "AdminConnection",
    "DataDirOption",
    "TokenOption",
    "UrlOption",
    "admin_client",
    "resolve_connection",
]

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Admin API base URL, e.g. http://127.0.0.1:8081. Else LLMGW_ADMIN_URL, else up.json.",
        show_default=False,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--admin-token",
        help="Admin token. Prefer LLMGW_ADMIN_TOKEN: a flag is visible to other users in `ps`.",
        show_default=False,
    ),
]
DataDirOption = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="Data dir of a local `llmgw up`, whose up.json names the admin URL and token.",
        show_default=False,
    ),
]

# A listing is read page by page; this bounds what one CLI call will fetch.
_MAX_PAGES = 1000
_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class AdminConnection:
    url: str
    token: str = ""

    def __repr__(self) -> str:  # the token must never reach a traceback or a log
        return f"AdminConnection(url={self.url!r}, token=<hidden>)"


def _from_up_json(data_dir: Path) -> AdminConnection | None:
    path = data_dir / "up.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read {path}: {type(exc).__name__}; is `llmgw up` running with this data dir?",
            field="--data-dir",
        ) from None
    url, token = info.get("admin_url"), info.get("admin_token")
    if not isinstance(url, str) or not isinstance(token, str):
        raise ConfigError(f"{path} has no admin_url/admin_token", field="--data-dir")
    return AdminConnection(url=url, token=token)


def resolve_connection(
    url: str | None, token: str | None, data_dir: Path | None
) -> AdminConnection:
    """The admin API to talk to; ConfigError naming every way to set it when none is found."""
    url = url or os.environ.get("LLMGW_ADMIN_URL") or None
    token = token or os.environ.get("LLMGW_ADMIN_TOKEN") or None
    if url is None or token is None:
        from llmgw.config import default_data_dir

        up = _from_up_json((data_dir or default_data_dir()).expanduser())
        if up is not None:
            url = url or up.url
            token = token or up.token
    if url is None:
        where = data_dir or "the default data dir"
        raise ConfigError(
            "no admin API to talk to: pass --url (or set LLMGW_ADMIN_URL), or run `llmgw up` "
            f"(its up.json in {where} names the URL and token), or pass --data-dir",
            field="--url",
        )
    if not token:
        raise ConfigError(
            "no admin token: set LLMGW_ADMIN_TOKEN (or pass --admin-token)", field="--admin-token"
        )
    return AdminConnection(url=url.rstrip("/"), token=token)


_ERRORS: dict[int, type[LlmgwError]] = {
    401: AuthError,
    403: AuthError,
    404: NotFoundError,
    409: ConflictError,
    422: SpecError,
}


class AdminClient:
    """A thin client of ``/admin/v1``; raises llmgw errors carrying the server's message."""

    def __init__(self, conn: AdminConnection, *, timeout_s: float = _TIMEOUT_S) -> None:
        self._conn = conn
        self._http = httpx.Client(
            base_url=conn.url,
            headers={"Authorization": f"Bearer {conn.token}"},
            timeout=timeout_s,
        )

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, json_body: Any = None, **params: Any) -> Any:
        r = self.send(method, path, json_body=json_body, **params)
        if r.status_code >= 400:
            raise self._error(r)
        return r.json() if r.content else None

    def send(
        self, method: str, path: str, *, json_body: Any = None, **params: Any
    ) -> httpx.Response:
        """The raw reply, error statuses included (for callers that read more of an error
        than its message, such as apply's list of problems); unreachable is still a
        ConfigError."""
        try:
            return self._http.request(
                method,
                "/admin/v1" + path,
                json=json_body,
                params={k: v for k, v in params.items() if v is not None},
            )
        except httpx.HTTPError as exc:
            raise ConfigError(
                f"cannot reach the admin API at {self._conn.url}: {type(exc).__name__}; is the "
                "control plane running, and is this its internal address?",
                field="--url",
            ) from None

    def error(self, r: httpx.Response) -> LlmgwError:
        """The llmgw error an error reply stands for, carrying the server's message."""
        return self._error(r)

    def list_all(self, kind: str, **params: Any) -> list[dict[str, Any]]:
        return list(self.iter_items(kind, **params))

    def iter_items(self, kind: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Every item of a listing, following ``next_cursor`` (bounded by _MAX_PAGES)."""
        cursor: str | None = None
        for _ in range(_MAX_PAGES):
            page = self.request("GET", f"/{kind}", cursor=cursor, **params)
            if isinstance(page, list):  # an endpoint that does not paginate
                yield from page
                return
            yield from page.get("items", [])
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def _error(self, r: httpx.Response) -> LlmgwError:
        message = f"the admin API answered {r.status_code}"
        field = None
        try:
            err = r.json().get("error", {})
            message = err.get("message") or message
            field = err.get("field")
        except ValueError:
            pass
        if r.status_code == 401:
            message += "; check LLMGW_ADMIN_TOKEN (or --admin-token, or the up.json in use)"
        cls = _ERRORS.get(r.status_code, LlmgwError)
        return cls(message, field=field)


def admin_client(url: str | None, admin_token: str | None, data_dir: Path | None) -> AdminClient:
    """The client every admin command opens from its --url / --admin-token / --data-dir."""
    return AdminClient(resolve_connection(url, admin_token, data_dir))
