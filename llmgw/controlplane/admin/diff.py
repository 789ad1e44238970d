"""What an apply changes in a stored object, field by field, for ``apply``'s reply.

Nested mappings (``env``, ``secret_env``) are compared key by key and named by dotted path
(``env.LOG_LEVEL``), so one changed variable is one line, not two whole maps; lists
(``args``, ``adapters``) are ordered, so a list is one value. A secret_env entry says only
that it was added, removed or changed: its reference is write-only (the admin API never
returns it), and what sits there may be a secret pasted where its reference belongs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from llmgw.controlplane.admin.schemas_fleet import ApplyChange

__all__ = ["field_changes"]


def _walk(
    prefix: str,
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    secret_paths: Collection[str],
    secret: bool,
) -> list[ApplyChange]:
    out: list[ApplyChange] = []
    # The document's own order (the schema's), then what only the stored object had.
    for key in [*new, *(k for k in old if k not in new)]:
        path = f"{prefix}{key}"
        hidden = secret or path in secret_paths
        if key not in old:
            out.append(_change(path, "added", None, new[key], hidden))
        elif key not in new:
            out.append(_change(path, "removed", old[key], None, hidden))
        elif isinstance(old[key], Mapping) and isinstance(new[key], Mapping):
            out += _walk(f"{path}.", old[key], new[key], secret_paths, hidden)
        elif old[key] != new[key]:
            out.append(_change(path, "changed", old[key], new[key], hidden))
    return out


def _change(path: str, change: str, old: Any, new: Any, secret: bool) -> ApplyChange:
    if secret:
        return ApplyChange.model_validate({"field": path, "change": change, "secret": True})
    return ApplyChange.model_validate({"field": path, "change": change, "old": old, "new": new})


def field_changes(
    old: Mapping[str, Any], new: Mapping[str, Any], *, secret: Collection[str] = ()
) -> list[ApplyChange]:
    """The fields of ``new`` whose value differs from the stored ``old``'s, in ``new``'s
    order. Whatever is inside a field named in ``secret`` is reported without values."""
    return _walk("", old, new, secret, False)
