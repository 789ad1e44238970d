"""`llmgw deployments scale NAME N`, `suspend NAME`, `resume NAME`."""

from __future__ import annotations

from typing import Annotated

import typer

from llmgw.commands._admin_client import (
    DataDirOption,
    TokenOption,
    UrlOption,
    admin_client,
)
from llmgw.commands._common import exit_on_error

__all__ = ["app"]

app = typer.Typer(help="Scale, suspend or resume deployments.", no_args_is_help=True)

DeploymentName = Annotated[str, typer.Argument(help="The deployment's name.")]


@app.command()
@exit_on_error
def scale(
    name: DeploymentName,
    replicas: Annotated[int, typer.Argument(min=0, help="The desired replica count.")],
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Set the desired replica count; the reconciler adds or drains replicas."""
    with admin_client(url, admin_token, data_dir) as client:
        out = client.request("POST", f"/deployments/{name}/scale", json_body={"replicas": replicas})
    typer.echo(f"deployment/{name} scaled to {out['replicas']}")


@app.command()
@exit_on_error
def suspend(
    name: DeploymentName,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Keep the replicas placed with their engines suspended (stopped where they cannot sleep)."""
    with admin_client(url, admin_token, data_dir) as client:
        client.request("POST", f"/deployments/{name}/suspend")
    typer.echo(f"deployment/{name} suspended")


@app.command()
@exit_on_error
def resume(
    name: DeploymentName,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Bring a suspended deployment's engines back."""
    with admin_client(url, admin_token, data_dir) as client:
        client.request("POST", f"/deployments/{name}/resume")
    typer.echo(f"deployment/{name} resumed")
