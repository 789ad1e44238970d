"""The syntax of a secret reference: `env:NAME` or `file:/absolute/path`.

A profile's secret_env maps a variable to a reference, never to the secret: the node
resolves it at launch (llmgw.nodeagent.secrets), so the secret never passes through the
control plane, its database, its WAL or its logs. This is the one check of what a
reference looks like, run by the admin API before a profile is stored and by the agent
before it resolves one, so both refuse the same inputs with the same words.

Pure: no environment, no files. A message names the variable and the rule, never the
value: what fails the check may be the secret itself, pasted where its reference belongs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from llmgw.errors import SpecError

__all__ = [
    "SecretReference",
    "check_secret_refs",
    "parse_secret_ref",
]

# What a variable of the agent's environment can be called: a systemd EnvironmentFile or a
# shell sets no other name, so `env:$HF_TOKEN` or `env:HF TOKEN` could never resolve.
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


_KERNEL_DIRS = ("proc", "sys", "dev")


@dataclass(frozen=True, slots=True)
class SecretReference:
    """A checked reference: the variable to read, or the absolute path of the file."""

    scheme: Literal["env", "file"]
    target: str


def parse_secret_ref(name: str, ref: str) -> SecretReference:
    """The reference ``ref`` of secret_env variable ``name``, or SpecError naming the rule."""
    field = f"profile.secret_env.{name}"
    if ref.startswith("env:"):
        var = ref[4:]
        if not var:
            raise SpecError(
                f"secret_env {name!r}: the env: reference names no variable; write "
                "env:NAME, NAME a variable of the agent's environment",
                field=field,
            )
        if _VARIABLE.fullmatch(var) is None:
            raise SpecError(
                f"secret_env {name!r}: an env: reference must name a variable of letters, "
                "digits and _ (not starting with a digit), as env:HF_TOKEN",
                field=field,
            )
        if var.upper().startswith("LLMGW_"):
            # The agent's environment holds llmgw's own settings and secrets (its bootstrap
            # token; under `llmgw up`, the control plane's admin token and database URL):
            # a profile that could name them would hand them to an engine. Case-blind, as
            # llmgw's settings read the environment.
            raise SpecError(
                f"secret_env {name!r}: an env: reference may not name an LLMGW_* variable: "
                "those are llmgw's own settings and credentials, never an engine's; put the "
                "engine's secret in a variable of its own (env:HF_TOKEN)",
                field=field,
            )
        return SecretReference("env", var)
    if ref.startswith("file:"):
        path = ref[5:]
        if not path.startswith("/"):
            raise SpecError(
                f"secret_env {name!r}: a file: reference must name an absolute path, "
                "as file:/run/secrets/hf_token",
                field=field,
            )
        parts = path.split("/")
        if ".." in parts or parts[1] in _KERNEL_DIRS:
            # /proc/self/environ is the agent's whole environment, its credentials included;
            # a ".." could walk anywhere a prefix check would not look.
            raise SpecError(
                f"secret_env {name!r}: a file: reference must name a secret file without "
                "'..' and outside /proc, /sys and /dev (kernel interfaces, the agent's own "
                "environment among them), as file:/run/secrets/hf_token",
                field=field,
            )
        return SecretReference("file", path)
    raise SpecError(
        f"secret_env {name!r}: value is not a reference; use env:NAME or file:/path (a "
        "secret value must not travel through the control plane)",
        field=field,
    )


def check_secret_refs(refs: Mapping[str, str]) -> dict[str, SecretReference]:
    """Every reference checked, by variable name; SpecError for the first bad one in name
    order (the same one on every run)."""
    return {name: parse_secret_ref(name, ref) for name, ref in sorted(refs.items())}
