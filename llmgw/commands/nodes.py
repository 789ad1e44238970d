"""`llmgw nodes cordon|uncordon|drain|approve|delete NAME`: the admins' side of a node."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import typer

from llmgw.commands._admin_client import (
    DataDirOption,
    TokenOption,
    UrlOption,
    admin_client,
)
from llmgw.commands._common import exit_on_error

__all__ = ["app"]

app = typer.Typer(help="Cordon, drain, approve or delete nodes.", no_args_is_help=True)

NodeName = Annotated[str, typer.Argument(help="The node's name (llmgw get nodes).")]


def _post(verb: str, name: str, url: str | None, token: str | None, data_dir: Path | None) -> None:
    with admin_client(url, token, data_dir) as client:
        # Percent-encoded: a node named before the name rule (a newline in it) stays reachable.
        client.request("POST", f"/nodes/{quote(name)}/{verb}")


@app.command()
@exit_on_error
def cordon(
    name: NodeName,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Place no new shards on the node; what runs there keeps running."""
    _post("cordon", name, url, admin_token, data_dir)
    typer.echo(f"node/{name} cordoned")


@app.command()
@exit_on_error
def uncordon(
    name: NodeName,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Make the node placeable again (and stop a drain)."""
    _post("uncordon", name, url, admin_token, data_dir)
    typer.echo(f"node/{name} uncordoned")


@app.command()
@exit_on_error
def drain(
    name: NodeName,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Cordon the node and move its replicas elsewhere, within each rollout budget."""
    _post("drain", name, url, admin_token, data_dir)
    typer.echo(f"node/{name} draining (watch: llmgw get nodes {name})")


@app.command()
@exit_on_error
def approve(
    name: NodeName,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Let a node that joined with an approval-requiring token take shards."""
    _post("approve", name, url, admin_token, data_dir)
    typer.echo(f"node/{name} approved")


@app.command()
@exit_on_error
def delete(
    name: NodeName,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Forget a node that holds no live shards (drain it first)."""
    with admin_client(url, admin_token, data_dir) as client:
        client.request("DELETE", f"/nodes/{quote(name)}")
    typer.echo(f"node/{name} deleted")
