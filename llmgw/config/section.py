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

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
