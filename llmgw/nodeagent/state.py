"""The agent's own state directory: its node credential, the cluster it joined, its epoch.

    <state_dir>/            0700
      identity.json         0600  node id, node credential, cluster id, control plane URL
      epoch                 0600  the last agent epoch used
      shards/               one directory per shard (records.py)
      kv/                   the KV relay's mirror of each engine, <shard>.mirror (kvrelay/state.py)

The credential is what the control plane trusts this node by; anyone who
reads it can report as this node, so it is 0600 in a 0700 directory and
never logged. The cluster id is the guard of docs/architecture.md §4: a control plane
that answers with another cluster id (a restored or foreign database) is
not obeyed.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmgw.errors import ConfigError
from llmgw.nodeagent.records import atomic_write

__all__ = ["AgentState", "NodeIdentity", "next_epoch"]


class NodeIdentity(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    node_id: str
    node_credential: str = Field(repr=False)
    cluster_id: str
    controlplane_url: str = ""


def next_epoch(previous: int, now_s: float) -> int:
    """A new epoch, larger than every earlier one even if the clock went back.

    Seconds since the epoch, so that an agent whose state dir was wiped
    still starts above what the control plane holds for its node (unless the
    clock is also wrong); previous + 1 when the clock has not moved past it.
    """
    return max(previous + 1, int(now_s))


class AgentState:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def shards_root(self) -> Path:
        return self.root / "shards"

    def ensure(self) -> None:
        """Create the directory 0700, or refuse one others can read."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        mode = stat.S_IMODE(self.root.stat().st_mode)
        if mode & 0o077:
            # Fix what we created loosely (umask), refuse nothing: the owner is us.
            os.chmod(self.root, 0o700)
        self.shards_root.mkdir(exist_ok=True, mode=0o700)

    # --- identity -----------------------------------------------------------------

    def load_identity(self) -> NodeIdentity | None:
        path = self.root / "identity.json"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ConfigError(
                f"{path}: cannot read the node identity ({e.strerror})", field="agent.state_dir"
            ) from None
        try:
            return NodeIdentity.model_validate_json(raw)
        except ValidationError:
            raise ConfigError(
                f"{path} is corrupt; move it away to register this node again (the control "
                "plane then sees a new node: delete the old one there)",
                field="agent.state_dir",
            ) from None

    def save_identity(self, identity: NodeIdentity) -> None:
        atomic_write(self.root / "identity.json", identity.model_dump_json().encode(), mode=0o600)

    # --- epoch --------------------------------------------------------------------

    def new_epoch(self) -> int:
        path = self.root / "epoch"
        previous = 0
        try:
            previous = int(path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            previous = 0
        epoch = next_epoch(previous, time.time())
        atomic_write(path, str(epoch).encode(), mode=0o600)
        return epoch
