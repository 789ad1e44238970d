"""Documents of desired state (models, profiles, adapters, deployments) read from a YAML file, as
`llmgw apply -f` and `llmgw up`'s demo send them to the admin API.

A plain function with plain errors, so every caller (the CLI, `llmgw up`) reads files the same
way and reports problems its own way. What it must not do: talk to the admin API, or check
documents against their schema (the control plane does that, for every client alike).

YAML is read stricter than the YAML spec allows (hardening-3 finding 13):

- **No anchors or aliases.** An alias is a pointer: nine levels of nine aliases each (a
  472-byte file) stand for 9^9 values, which the JSON body sent to the admin API spelt out in
  full (3 GB). Desired state never needs them; refused while parsing, before anything is
  built.
- **No duplicate keys.** YAML says a mapping's keys are unique, but PyYAML keeps the last
  silently: `replicas: 2` then `replicas: 0` applied 0.
- **Bounded**: the file's size, its values (nodes) and how deep they nest.

Every refusal names the line and the fix.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmgw.errors import SpecError

__all__ = [
    "MAX_DEPTH",
    "MAX_NODES",
    "DocumentsError",
    "load_yaml",
    "parse_documents",
    "read_documents",
]


class DocumentsError(SpecError):
    """Documents of the file that are not mappings: every problem, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems), field="-f")
        self.problems = problems


# A fleet's whole desired state is a few hundred objects; far past that is the wrong file.
_MAX_FILE_BYTES = 8 * 1024 * 1024
# Values (scalars, lists, mappings) in one file: a few hundred objects of a few dozen fields
# each is some 10^4; each value costs hundreds of bytes once built, so 8 MiB of `[1,1,1,...]`
# (4M values, a GB or two) is refused before it is built.
MAX_NODES = 200_000
# Deeper than any document's fields (a profile's adapters are 3 levels); far below the
# recursion that PyYAML's constructor would hit.
MAX_DEPTH = 64


class _Refused(Exception):
    """A document the loader refuses: the message names the line and the fix."""


def _loader_class() -> type[Any]:
    import yaml
    from yaml.events import AliasEvent, CollectionStartEvent, NodeEvent
    from yaml.nodes import MappingNode

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader without anchors, aliases or duplicate keys, bounded in size and depth.

        The pure-Python parser on purpose: the checks run as each event is composed, before a
        value is built (libyaml's composer cannot be hooked); documents are small."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.nodes = 0
            self.depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()  # type: ignore[no-untyped-call]
            line = event.start_mark.line + 1
            if isinstance(event, AliasEvent):
                raise _Refused(
                    f"line {line}: an alias (*{event.anchor}) is not accepted: anchors and "
                    "aliases let a few bytes stand for gigabytes; write the value out in full "
                    "where it is used"
                )
            if isinstance(event, NodeEvent) and event.anchor is not None:
                raise _Refused(
                    f"line {line}: an anchor (&{event.anchor}) is not accepted: anchors and "
                    "aliases let a few bytes stand for gigabytes; remove it and write the "
                    "value out in full where it is used"
                )
            self.nodes += 1
            if self.nodes > MAX_NODES:
                raise _Refused(
                    f"line {line}: the file holds more than {MAX_NODES} values; split it "
                    "into several files"
                )
            nested = isinstance(event, CollectionStartEvent)
            if nested:
                self.depth += 1
                if self.depth > MAX_DEPTH:
                    raise _Refused(
                        f"line {line}: the file nests too deeply (values more than "
                        f"{MAX_DEPTH} levels down); no document's fields go that deep: check "
                        "the indentation"
                    )
            try:
                return super().compose_node(parent, index)
            finally:
                if nested:
                    self.depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _value in node.value:
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        first = seen.get(key)
                        seen.setdefault(key, line)
                    except TypeError:  # an unhashable key: SafeConstructor refuses it itself
                        continue
                    if first is not None:
                        raise _Refused(
                            f"line {line}: key {key!r} is given twice in one mapping (first "
                            f"on line {first}); YAML keeps only one of them: remove the one "
                            "you do not mean"
                        )
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _documents(text: str) -> Iterator[Any]:
    """Each document of ``text``, loaded by the strict loader; _Refused or yaml.YAMLError."""
    loader = _loader_class()(text)
    try:
        while loader.check_data():
            yield loader.get_data()
    finally:
        loader.dispose()


def _yaml_problem(source: str, exc: Exception) -> SpecError:
    if isinstance(exc, _Refused):
        return SpecError(f"{source}: {exc}", field="-f")
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or type(exc).__name__
    return SpecError(f"{source} is not valid YAML{where}: {problem}", field="-f")


def load_yaml(text: str, source: str) -> Any:
    """The one YAML document of ``text`` (None when empty), read as ``read_documents`` reads
    files: no anchors, aliases or duplicate keys, bounded. SpecError naming ``source``, the
    line and the fix."""
    import yaml

    try:
        docs = list(_documents(text))
    except (_Refused, yaml.YAMLError) as exc:
        raise _yaml_problem(source, exc) from None
    if len(docs) > 1:
        raise SpecError(
            f"{source} holds {len(docs)} YAML documents; give one (no `---` between two)",
            field="-f",
        )
    return docs[0] if docs else None


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


def parse_documents(text: str, source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The non-empty documents of YAML ``text`` and each one's 1-based position in it."""
    import yaml

    docs: list[dict[str, Any]] = []
    positions: list[int] = []
    problems: list[str] = []
    try:
        for n, doc in enumerate(_documents(text), start=1):
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
    except (_Refused, yaml.YAMLError) as exc:
        raise _yaml_problem(source, exc) from None
    if problems:
        raise DocumentsError(problems)
    return docs, positions


def read_documents(source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The file's non-empty documents and each one's 1-based position in the file."""
    return parse_documents(_read_text(source), source)
