"""`llmgw apply -f FILE [--dry-run]`: models, profiles and deployments from YAML, all or nothing.

The file holds one or more YAML documents (separated by ``---``), each a mapping with
``kind: model|profile|deployment`` and that kind's fields as the admin API takes them.
The control plane checks every document before it writes anything; when any is wrong,
every problem is printed and the exit status is 1. Otherwise one line per object says
``created``, ``configured`` or ``unchanged``.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from llmgw.commands._admin_client import (
    DataDirOption,
    TokenOption,
    UrlOption,
    admin_client,
)
from llmgw.commands._common import exit_on_error
from llmgw.documents import DocumentsError, read_documents
from llmgw.errors import SpecError

__all__ = ["apply"]


def _describe(problem: dict[str, Any], positions: list[int]) -> str:
    index = problem.get("index")
    n = positions[index] if isinstance(index, int) and 0 <= index < len(positions) else index
    what = f"document {n}"
    if problem.get("kind") and problem.get("name"):
        what += f" ({problem['kind']}/{problem['name']})"
    elif problem.get("kind"):
        what += f" ({problem['kind']})"
    field = problem.get("field")
    message = str(problem.get("message", ""))
    if field and not message.startswith(f"{field}:") and f"'{field}'" not in message:
        message = f"{field}: {message}"
    return f"{what}: {message}"


@exit_on_error
def apply(
    filename: Annotated[
        str,
        typer.Option(
            "--filename", "-f", help="YAML file of models, profiles and deployments; - for stdin."
        ),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would change; write nothing.")
    ] = False,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Create or update everything a file declares, in one transaction, like `kubectl apply`.

    Each document names its `kind` (model, profile or deployment) and the fields the
    admin API takes for it. Nothing is written unless every document is right; then each
    object prints as created, configured (changed) or unchanged. Exit status 1 lists
    every problem.
    """
    try:
        docs, positions = read_documents(filename)
    except DocumentsError as exc:
        for p in exc.problems:
            typer.echo(f"error: {p}", err=True)
        raise typer.Exit(1) from None
    if not docs:
        raise SpecError(f"{filename} holds no documents", field="-f")
    with admin_client(url, admin_token, data_dir) as client:
        r = client.send("POST", "/apply", json_body={"documents": docs, "dry_run": dry_run})
        if r.status_code == 422:
            error = r.json().get("error", {})
            problems = error.get("problems")
            if isinstance(problems, list) and problems:
                for p in problems:
                    typer.echo(f"error: {_describe(p, positions)}", err=True)
                typer.echo(
                    f"nothing was applied: {len(problems)} problem(s) in {filename}", err=True
                )
                raise typer.Exit(1)
        if r.status_code >= 400:
            raise client.error(r)
        reply = r.json()
    suffix = " (dry run)" if dry_run else ""
    for result in reply.get("results", []):
        typer.echo(f"{result['kind']}/{result['name']} {result['result']}{suffix}")
