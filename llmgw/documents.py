"""Documents of desired state (models, profiles, deployments) read from a YAML file, as
`llmgw apply -f` and `llmgw up`'s demo send them to the admin API.

A plain function with plain errors, so every caller (the CLI, `llmgw up`) reads files the same
way and reports problems its own way. What it must not do: talk to the admin API, or check
documents against their schema (the control plane does that, for every client alike).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from llmgw.errors import SpecError

__all__ = ["DocumentsError", "read_documents"]


class DocumentsError(SpecError):
    """Documents of the file that are not mappings: every problem, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems), field="-f")
        self.problems = problems


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
        raise DocumentsError(problems)
    return docs, positions
