"""What every settings section is, and the one section every process reads, ``[log]``.

A section refuses keys it does not know and validates its defaults, so a misspelt key or
a default that breaks a rule fails at start, naming the key.

What it must not do: read the environment or a file (loading.py does).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LogSettings", "Section"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class LogSettings(Section):
    level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    # None: JSON lines when stderr is not a terminal, console output when it is.
    json_lines: bool | None = Field(default=None, alias="json")
    file: str = Field(
        default="",
        description="Write the process's log, and anything else it prints to stdout or "
        "stderr, to this file instead, rotated at max_bytes. `llmgw up` sets it for its "
        "children (<data dir>/logs/<child>.log). Empty: stderr (journald under systemd "
        "rotates it itself).",
    )
    max_bytes: int = Field(
        default=64 << 20,
        ge=1 << 20,
        description="Size at which log.file is moved to <file>.1 and a new one started "
        "(default 64 MiB). Checked every MiB written, so a file may pass it by up to that.",
    )
    backups: int = Field(
        default=3,
        ge=0,
        le=100,
        description="Rotated log files kept (<file>.1 newest ... <file>.N); 0 keeps none. "
        "Default 3: log.file takes at most (backups + 1) x max_bytes of disk.",
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
