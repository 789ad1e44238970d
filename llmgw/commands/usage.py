"""`llmgw usage`: tokens and requests per key and model, from `GET /admin/v1/usage`."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any

import typer

from llmgw.commands._admin_client import (
    DataDirOption,
    TokenOption,
    UrlOption,
    admin_client,
)
from llmgw.commands._common import exit_on_error
from llmgw.commands.keys import parse_time
from llmgw.commands.tables import render_table

__all__ = ["render_usage", "usage"]


class Output(StrEnum):
    table = "table"
    json = "json"


class Group(StrEnum):
    total = "total"
    day = "day"
    hour = "hour"
    minute = "minute"


_COUNTS = (
    ("REQUESTS", "requests"),
    ("PROMPT", "prompt_tokens"),
    ("CACHED", "cached_tokens"),
    ("COMPLETION", "completion_tokens"),
    ("TOTAL", "total_tokens"),
)


def render_usage(items: list[dict[str, Any]], *, with_start: bool) -> str:
    head = ["KEY", "MODEL"] + (["START"] if with_start else []) + [h for h, _ in _COUNTS]
    rows = [
        [i["key"], i["model"]] + ([i["start"]] if with_start else []) + [i[f] for _, f in _COUNTS]
        for i in items
    ]
    return render_table(head, rows)


@exit_on_error
def usage(
    key: Annotated[str | None, typer.Option(help="Only this key (its name or id).")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    since: Annotated[
        str | None,
        typer.Option(help="From: a date, an ISO time (UTC without an offset), or 24h / 7d ago."),
    ] = None,
    until: Annotated[str | None, typer.Option(help="Before: as --since.")] = None,
    group: Annotated[
        Group, typer.Option(help="Sum over the range, or per UTC day, hour or minute.")
    ] = Group.total,
    output: Annotated[Output, typer.Option("--output", "-o", help="Output format.")] = Output.table,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Tokens and requests the gateways accounted, per key and model (about a second late)."""
    params = {
        "key": key,
        "model": model,
        "since": None if since is None else parse_time(since, option="--since", past=True),
        "until": None if until is None else parse_time(until, option="--until", past=True),
        "group": group.value,
        "limit": 10_000,
    }
    with admin_client(url, admin_token, data_dir) as client:
        reply = client.request("GET", "/usage", **params)
    items = reply["items"]
    if output is Output.json:
        typer.echo(json.dumps(items, indent=2, sort_keys=True))
    else:
        typer.echo(render_usage(items, with_start=group is not Group.total))
    if reply.get("truncated"):
        typer.echo(
            f"(only the first {len(items)} rows: narrow it with --key, --model or --since)",
            err=True,
        )
