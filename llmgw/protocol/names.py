"""The one rule for every name llmgw stores and clients type: models, profiles,
deployments, adapters, GPU classes, API keys and nodes.

A name travels in URLs (`/admin/v1/nodes/{name}`), shells (`llmgw nodes delete NAME`),
Prometheus labels and table cells, so it holds only characters that survive all of them
unescaped. A newline, an escape sequence or a space in a name made a node unreachable
through the admin API and let a node's registration paint fake rows into `llmgw status`
(hardening-3 finding 10); one definition here, checked by the admin API, the agent API's
registration, the agent's own settings and the database's CHECK constraints alike, keeps
every entry point to the same rule.

Pure: no I/O. Messages name the rule and an example, and quote the offending name with
``repr`` so a control character in it is shown, never acted on by a terminal.
"""

from __future__ import annotations

import re

__all__ = [
    "KEY_NAME_PATTERN",
    "MAX_NAME_CHARS",
    "NAME_PATTERN",
    "NAME_RULE",
    "key_name_problem",
    "name_problem",
    "segment_problem",
]

# What clients type in "model": letters and digits first, then letters, digits and ._:/-.
# Slashes for Hugging Face's "org/model"; 128 characters in all.
NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
# API key names appear in `llmgw keys revoke NAME` and in URLs: no slashes, unlike models;
# @ for "team@tenant" spellings.
KEY_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
MAX_NAME_CHARS = 128
NAME_RULE = (
    "1 to 128 characters: a letter or digit, then letters, digits and . _ : / - "
    "(no spaces or control characters), e.g. 'gpu-node-01' or 'org/model-v1'"
)
_KEY_NAME_RULE = (
    "1 to 128 characters: a letter or digit, then letters, digits and . _ : @ - "
    "(no slashes, spaces or control characters), e.g. 'team-a'"
)

_NAME = re.compile(NAME_PATTERN)
_KEY_NAME = re.compile(KEY_NAME_PATTERN)


def _shown(name: str) -> str:
    # repr escapes control characters; clipped so a 1 MB name is not echoed back whole.
    return repr(name if len(name) <= 160 else name[:160] + "...")


def segment_problem(name: str) -> str | None:
    """Why ``name``'s slashes make it unaddressable, or None: never an empty, "." or ".."
    segment between slashes, since ordinary clients normalise such paths before sending them
    (`DELETE /admin/v1/models/a/../b` would arrive as a delete of model "b")."""
    if not name:
        return "a name must not be empty"
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            return (
                f"a name must not have an empty, '.' or '..' segment between slashes (got "
                f"{segment!r}): HTTP clients rewrite such paths, so the object could not be "
                "addressed reliably; use e.g. 'org/model-v1'"
            )
    return None


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an object's or a node's name, or None when it can: the
    pattern, then the segment rule."""
    if not name:
        return "a name must not be empty"
    # fullmatch, not match: Python's `$` also matches before a trailing newline.
    if _NAME.fullmatch(name) is None:
        return f"{_shown(name)} is not a valid name: use {NAME_RULE}"
    return segment_problem(name)


def key_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an API key's name, or None when it can."""
    if _KEY_NAME.fullmatch(name) is None:
        return f"{_shown(name)} is not a valid key name: use {_KEY_NAME_RULE}"
    return None
