"""The ``[up]`` section, and where `llmgw up` keeps its data when not told.

What it must not do: read the environment beyond XDG_DATA_HOME, or a file (loading.py does).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from llmgw.config.section import Section

__all__ = ["UpSettings", "default_data_dir"]


class UpSettings(Section):
    data_dir: str = Field(
        default="", description="Persistent data of `llmgw up`. Empty: $XDG_DATA_HOME/llmgw."
    )
    demo: bool = Field(default=True, description="Create the demo model on the simulator engine.")


def default_data_dir() -> Path:
    """Where `llmgw up` keeps its data when not told.

    $XDG_DATA_HOME/llmgw (~/.local/share/llmgw when unset or relative, as the XDG spec
    says); as root, /var/lib/llmgw instead: root's home is 0700, and the private
    Postgres runs as the `postgres` user, which could not enter a data dir under it.
    """
    xdg = os.environ.get("XDG_DATA_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "llmgw"
    if os.geteuid() == 0:
        return Path("/var/lib/llmgw")
    return Path.home() / ".local" / "share" / "llmgw"
