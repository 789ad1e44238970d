"""A fully resolved launch: what to exec, with which environment and files.

A `Command` is data the agent executes; building one is the adapters' job and
running one the supervisor's. This module must NOT start processes or write
files: `CommandFile` describes a file for the agent to write before exec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmgw.engines.env import is_secret_name

__all__ = ["REDACTED", "Command", "CommandFile", "redact_commands", "redact_secret_names"]

REDACTED = "<redacted>"
_MIN_SUBSTRING_SECRET = 8


class CommandFile(BaseModel):
    """A file the agent writes, with this mode, before starting the command.

    SGLang reads its API key from a config file because it has no environment
    variable for it; the file is private (0600) because the key is.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Where to write it: under ShardSpec.runtime_dir, or relative to the
    # directory the shard starts in when that is empty.
    path: str = Field(min_length=1)
    mode: int = 0o600
    content: str = Field(repr=False)
    # Whether content holds a secret, so tools redact it.
    secret: bool = False


class Command(BaseModel):
    """One process of a shard."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Distinguishes the processes of a multi-process shard in logs.
    name: str
    path: str
    args: tuple[str, ...] = ()
    # The complete environment, not a delta, sorted by name so a command is
    # reproducible and diffable in logs.
    env: dict[str, str] = Field(default_factory=dict, repr=False)
    files: tuple[CommandFile, ...] = ()
    # Hold this command until leader_addr:leader_port accepts a connection.
    # Exists for Ray: the head must listen before the server or a worker can
    # join it, and both sides express the wait because both dial that address.
    wait_for_leader_port: bool = False

    @field_validator("env")
    @classmethod
    def _sorted_env(cls, v: dict[str, str]) -> dict[str, str]:
        return dict(sorted(v.items()))

    @property
    def argv(self) -> tuple[str, ...]:
        return (self.path, *self.args)

    def to_json_dict(self, *, include_files: bool = True) -> dict[str, Any]:
        """The operator-facing JSON shape (`llmgw engines command`)."""
        out: dict[str, Any] = {
            "name": self.name,
            "path": self.path,
            "args": list(self.args),
            "env": dict(self.env),
            "wait_for_leader_port": self.wait_for_leader_port,
        }
        if include_files and self.files:
            out["files"] = [f.model_dump(mode="json") for f in self.files]
        return out


def redact_commands(commands: list[Command], secrets: Mapping[str, str]) -> list[Command]:
    """The commands with every secret value replaced by REDACTED.

    `secrets` maps a label to a secret value (the API key, each secret_env
    value). Replacing by value, not by variable name, also catches a secret
    that an adapter placed somewhere unexpected.
    """
    values = sorted({v for v in secrets.values() if v}, key=len, reverse=True)

    def scrub(text: str) -> str:
        if text in values:
            return REDACTED
        for v in values:
            # Substrings only for values long enough not to hit by chance: a
            # one-letter test key would otherwise blank out every such letter.
            if len(v) >= _MIN_SUBSTRING_SECRET:
                text = text.replace(v, REDACTED)
        return text

    out = []
    for c in commands:
        files = tuple(
            f.model_copy(update={"content": REDACTED if f.secret else scrub(f.content)})
            for f in c.files
        )
        out.append(
            c.model_copy(
                update={
                    "args": tuple(scrub(a) for a in c.args),
                    "env": {k: scrub(v) for k, v in c.env.items()},
                    "files": files,
                }
            )
        )
    return out


def _redact_args(args: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("-") and is_secret_name(arg.split("=", 1)[0]):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return tuple(out)


def redact_secret_names(commands: list[Command]) -> list[Command]:
    """The commands with the value of every secret-looking variable or flag replaced.

    For showing commands to people: whatever the value, `AWS_SECRET_ACCESS_KEY`
    or `--hf-token X` is shown as REDACTED (env.is_secret_name says which).
    """
    return [
        c.model_copy(
            update={
                "args": _redact_args(c.args),
                "env": {k: REDACTED if is_secret_name(k) else v for k, v in c.env.items()},
            }
        )
        for c in commands
    ]
