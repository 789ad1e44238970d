"""`llmgw apply -f FILE [--dry-run]`: models, profiles and deployments from YAML, all or nothing.

The file holds one or more YAML documents (separated by ``---``), each a mapping with
``kind: model|profile|deployment`` and that kind's fields as the admin API takes them.
The control plane checks every document before it writes anything; when any is wrong,
every problem is printed and the exit status is 1. Otherwise one line per object says
``created``, ``configured`` or ``unchanged``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from llmgw.commands._admin_client import (
    DataDirOption,
    TokenOption,
    UrlOption,
    admin_client,
)
from llmgw.commands._common import exit_on_error
from llmgw.errors import SpecError

__all__ = ["apply", "read_documents"]

# A fleet's whole desired state is a few hundred objects; far past that is the wrong file.
_MAX_FILE_BYTES = 8 * 1024 * 1024


def _read_text(source: str) -> str:
    if source == "-":
        text = sys.stdin.read(_MAX_FILE_BYTES + 1)
        where = "standard input"
    else:
        path = Path(source)
        try:
            with path.open("r", encoding="utf-8") as f:
                text = f.read(_MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise SpecError(f"cannot read {source}: {exc.strerror or exc}", field="-f") from None
        except UnicodeDecodeError:
            raise SpecError(f"{source} is not UTF-8 text", field="-f") from None
        where = source
    if len(text) > _MAX_FILE_BYTES:
        raise SpecError(
            f"{where} is larger than {_MAX_FILE_BYTES // (1024 * 1024)} MiB; split it", field="-f"
        )
    return text


def read_documents(source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The file's non-empty documents and each one's 1-based position in the file."""
    import yaml

    text = _read_text(source)
    docs: list[dict[str, Any]] = []
    positions: list[int] = []
    problems: list[str] = []
    try:
        for n, doc in enumerate(yaml.safe_load_all(text), start=1):
            if doc is None:  # an empty document: a leading or trailing `---`
                continue
            if not isinstance(doc, dict):
                problems.append(
                    f"document {n}: is a {type(doc).__name__}, not a mapping with `kind:` "
                    "and the object's fields"
                )
                continue
            docs.append(doc)
            positions.append(n)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise SpecError(f"{source} is not valid YAML{where}: {problem}", field="-f") from None
    if problems:
        for p in problems:
            typer.echo(f"error: {p}", err=True)
        raise typer.Exit(1)
    return docs, positions


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
    docs, positions = read_documents(filename)
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
