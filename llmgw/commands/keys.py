"""`llmgw keys create|list|revoke`: the API keys clients of the gateway send."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer

from llmgw.commands._admin_client import (
    DataDirOption,
    TokenOption,
    UrlOption,
    admin_client,
)
from llmgw.commands._common import exit_on_error
from llmgw.commands.tokens import parse_duration_s
from llmgw.errors import SpecError

__all__ = ["app", "parse_time"]

app = typer.Typer(help="Create, list or revoke API keys of the gateway.", no_args_is_help=True)

_DURATION = re.compile(r"^[0-9]{1,9}[smhd]$")


def parse_time(text: str, *, option: str, now: datetime | None = None, past: bool = False) -> str:
    """An ISO time or date (UTC when it has no offset; a date is its midnight), or a duration
    (30m, 24h, 7d) from now: forward for an expiry, back with ``past``. ISO text for the API."""
    value = text.strip()
    now = now or datetime.now(UTC)
    if _DURATION.match(value):
        delta = timedelta(seconds=parse_duration_s(value))
        return (now - delta if past else now + delta).isoformat()
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        example = "24h ago: 24h" if past else "in 30 days: 30d"
        raise SpecError(
            f"{option} {text!r} is neither a time nor a duration; write e.g. 2026-12-31, "
            f"2026-12-31T18:00:00+00:00, or a duration ({example})",
            field=option,
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.isoformat()


def _models(text: str | None) -> list[str] | None:
    if text is None:
        return None
    models = [m.strip() for m in text.split(",") if m.strip()]
    if not models:
        raise SpecError(
            "--models is empty; name the models the key may use (m1,m2), or leave it out "
            "for every model",
            field="--models",
        )
    return models


def _limits(out: dict[str, Any]) -> str:
    parts = []
    if out.get("allowed_models") is not None:
        parts.append("models " + ",".join(out["allowed_models"]))
    if out.get("rate_limit_rpm") is not None:
        parts.append(f"{out['rate_limit_rpm']} requests/min")
    if out.get("rate_limit_tpm") is not None:
        parts.append(f"{out['rate_limit_tpm']} tokens/min")
    if out.get("token_quota") is not None:
        parts.append(f"{out['token_quota']} tokens per {out['quota_period']}")
    if out.get("concurrency_limit") is not None:
        parts.append(f"{out['concurrency_limit']} in flight")
    if out.get("priority"):
        parts.append(f"queue priority {out['priority']}")
    if out.get("cache_salted"):
        parts.append("own KV cache (salted)")
    if out.get("expires_at"):
        parts.append(f"expires {out['expires_at']}")
    return "; ".join(parts) or "no limits"


@app.command()
@exit_on_error
def create(
    name: Annotated[str, typer.Argument(help="Unique name: letters, digits and ._:@-.")],
    models: Annotated[
        str | None, typer.Option(help="Models it may use, comma-separated (default: every one).")
    ] = None,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute (per gateway).")] = None,
    tpm: Annotated[
        int | None, typer.Option(help="Tokens per minute, prompt + completion (per gateway).")
    ] = None,
    quota: Annotated[
        int | None, typer.Option(help="Tokens (prompt + completion) per --period.")
    ] = None,
    period: Annotated[
        str | None, typer.Option(help="The quota's period, UTC: day or month (default month).")
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Requests in flight at once (per gateway).")
    ] = None,
    priority: Annotated[
        int,
        typer.Option(
            help="Weight in the gateway queue while keys wait: served priority + 1 times the "
            "tokens of a priority-0 key (0-100)."
        ),
    ] = 0,
    expires: Annotated[
        str | None,
        typer.Option(help="When it stops working: a date, an ISO time, or a duration (90d)."),
    ] = None,
    cache_salt: Annotated[
        bool,
        typer.Option(
            "--cache-salt",
            help="Tenant isolation: its requests never share KV cache with other keys'.",
        ),
    ] = False,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Create a key and print it. It is shown this once: only its hash is stored."""
    if period is not None and period not in ("day", "month"):
        raise SpecError(f"--period {period!r} must be day or month", field="--period")
    if period is not None and quota is None:
        raise SpecError(
            "--period without --quota limits nothing; give --quota TOKENS too", field="--period"
        )
    body: dict[str, Any] = {
        "name": name,
        "models": _models(models),
        "rpm": rpm,
        "tpm": tpm,
        "quota": quota,
        "period": period,
        "concurrency": concurrency,
        "priority": priority,
        "expires_at": None if expires is None else parse_time(expires, option="--expires"),
        "cache_salt": cache_salt,
    }
    with admin_client(url, admin_token, data_dir) as client:
        out = client.request("POST", "/keys", json_body=body)
    typer.echo(out["key"])
    typer.echo(
        f"key {out['name']} ({out['id']}): {_limits(out)}. It is not shown again; clients send "
        "it as `Authorization: Bearer <key>` (the openai client's api_key).",
        err=True,
    )


@app.command("list")
@exit_on_error
def list_(
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """List keys (never their secrets), revoked ones included."""
    from llmgw.commands.get import get

    get("keys", url=url, admin_token=admin_token, data_dir=data_dir)


@app.command()
@exit_on_error
def revoke(
    name: Annotated[str, typer.Argument(help="The key's name (llmgw keys list).")],
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Every gateway refuses the key within a second; its usage is kept."""
    with admin_client(url, admin_token, data_dir) as client:
        client.request("POST", f"/keys/{name}/revoke")
    typer.echo(f"key/{name} revoked")
