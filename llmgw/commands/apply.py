"""`llmgw apply -f FILE [--dry-run]`: models, profiles, adapters and deployments from YAML, all or
nothing.

The file holds one or more YAML documents (separated by ``---``), each a mapping with
``kind: model|profile|adapter|deployment`` and that kind's fields as the admin API takes them.
The control plane checks every document before it writes anything; when any is wrong,
every problem is printed and the exit status is 1. Otherwise one line per object says
``created``, ``configured`` or ``unchanged``; with ``--dry-run``, a configured object's
line is followed by what it would change, field by field, and whether it would roll
replicas:

    deployment/demo configured (dry run)
        profile: demo-sim → demo-sim-big
        replicas: 4 → 2
        would roll 2 replicas
"""

from __future__ import annotations

import json
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

_FINGERPRINT_CHARS = 12


def _show(value: Any) -> str:
    # Names and counts read as themselves (`profile: a → b`); anything that would not
    # (an empty string, a list, a boolean) as JSON.
    if isinstance(value, str) and value and value.strip() == value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


def _change_line(change: dict[str, Any]) -> str:
    field, kind = change.get("field"), change.get("change")
    if change.get("secret"):
        # The server never sends a secret_env reference; say only what happened to it.
        return f"{field}: {kind}" + ("" if kind == "removed" else " (value not shown)")
    old = "(absent)" if kind == "added" else _show(change.get("old"))
    new = "(absent)" if kind == "removed" else _show(change.get("new"))
    if field == "fingerprint":  # as `llmgw get` shows it: enough to tell two apart
        old, new = old[:_FINGERPRINT_CHARS], new[:_FINGERPRINT_CHARS]
    return f"{field}: {old} → {new}"


def _roll_line(result: dict[str, Any]) -> str:
    n = int(result.get("rolls") or 0)
    if n == 0:
        return "no roll"
    line = f"would roll {n} replica{'s' if n != 1 else ''}"
    names = list(result.get("rolled_deployments") or [])
    # A deployment's roll is its own; a profile's is its deployments', so name them.
    if result.get("kind") == "profile" and names:
        line += f" (deployment{'s' if len(names) > 1 else ''} {', '.join(names)})"
    return line


def _print_result(result: dict[str, Any], dry_run: bool) -> None:
    suffix = " (dry run)" if dry_run else ""
    typer.echo(f"{result['kind']}/{result['name']} {result['result']}{suffix}")
    if not dry_run or result.get("result") != "configured":
        return
    for change in result.get("changes") or []:
        typer.echo(f"    {_change_line(change)}")
    if result.get("kind") in ("profile", "deployment"):
        typer.echo(f"    {_roll_line(result)}")


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
    named = message.startswith(f"{field}:") or f"'{field}'" in message or f"`{field}`" in message
    if field and not named:
        message = f"{field}: {message}"
    return f"{what}: {message}"


@exit_on_error
def apply(
    filename: Annotated[
        str,
        typer.Option(
            "--filename",
            "-f",
            help="YAML file of models, profiles, adapters and deployments; - for stdin.",
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

    Each document names its `kind` (model, profile, adapter or deployment) and the fields
    the admin API takes for it. Nothing is written unless every document is right; then each
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
    for result in reply.get("results", []):
        _print_result(result, dry_run)
