"""`llmgw tokens create|list|revoke`: bootstrap tokens, what lets a new node's agent join."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from llmgw.commands._admin_client import (
    DataDirOption,
    TokenOption,
    UrlOption,
    admin_client,
)
from llmgw.commands._common import exit_on_error
from llmgw.errors import SpecError

__all__ = ["app", "parse_duration_s"]

app = typer.Typer(help="Create, list or revoke bootstrap tokens.", no_args_is_help=True)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
_DURATION = re.compile(r"^([0-9]{1,9})([smhd]?)$")


def parse_duration_s(text: str) -> int:
    """'90s', '30m', '24h', '7d' or plain seconds."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise SpecError(
            f"--ttl {text!r} is not a duration; write e.g. 30m, 24h or 7d", field="--ttl"
        )
    return int(match.group(1)) * _UNITS[match.group(2) or "s"]


def _uses(text: str) -> int | None:
    if text.strip().lower() in ("unlimited", "any"):
        return None
    if not text.strip().isdigit():
        raise SpecError(
            f"--uses {text!r} must be a count of nodes (e.g. 1, 10) or 'unlimited'",
            field="--uses",
        )
    return int(text)


@app.command()
@exit_on_error
def create(
    pool: Annotated[str, typer.Option(help="Pool of the nodes that join with it.")] = "default",
    ttl: Annotated[str, typer.Option(help="Lifetime: 30m, 24h, 7d (at most 30d).")] = "24h",
    uses: Annotated[
        str, typer.Option(help="How many nodes may join with it, or 'unlimited'.")
    ] = "1",
    require_approval: Annotated[
        bool,
        typer.Option(
            "--require-approval", help="Nodes wait for `llmgw nodes approve` before taking work."
        ),
    ] = False,
    description: Annotated[str, typer.Option(help="What it is for.")] = "",
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Create a token and print it. It is shown this once: only its hash is stored."""
    body = {
        "pool": pool,
        "ttl_s": parse_duration_s(ttl),
        "uses": _uses(uses),
        "require_approval": require_approval,
        "description": description,
    }
    with admin_client(url, admin_token, data_dir) as client:
        out = client.request("POST", "/bootstrap-tokens", json_body=body)
    typer.echo(out["token"])
    uses_text = "any number of nodes" if out["uses_left"] is None else f"{out['uses_left']} node(s)"
    typer.echo(
        f"bootstrap token {out['id']}: pool {out['pool']}, {uses_text}, expires "
        f"{out['expires_at']}{', nodes wait for approval' if out['require_approval'] else ''}. "
        "It is not shown again; give it to `llmgw agent` (LLMGW_AGENT__BOOTSTRAP_TOKEN).",
        err=True,
    )


@app.command("list")
@exit_on_error
def list_(
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """List tokens (never their secrets)."""
    from llmgw.commands.get import get

    get("bootstrap-tokens", url=url, admin_token=admin_token, data_dir=data_dir)


@app.command()
@exit_on_error
def revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (llmgw tokens list).")],
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """No node can join with the token from now on; nodes that joined stay."""
    with admin_client(url, admin_token, data_dir) as client:
        client.request("DELETE", f"/bootstrap-tokens/{token_id}")
    typer.echo(f"bootstrap-token/{token_id} revoked")
