"""A profile's fingerprint: which version of a profile a running shard was started from.

The control plane stores it with each shard and rolls replicas whose
fingerprint differs from the catalog's (design §3). It must change with every
field that changes the launched process and with nothing else, so:

- it hashes canonical JSON (sorted keys, no whitespace) of a fixed list of
  fields, so dict order and the formatting of the document a profile came from
  (YAML or JSON, indentation, key order) never change it;
- list order counts where the engine sees it: args and adapters (an adapter's
  index is its id in llama.cpp);
- each arg is content, compared exactly: whitespace inside an arg counts
  ("--x  1" as one argv element is another argument than "--x 1"), and args
  are never re-split, since a profile holds an argv list, not a shell string;
- secret values never enter it (editing a secret must not roll replicas, and
  a hash of a low-entropy secret would leak it). The *names* of secret_env
  variables do count, though design §3 keeps secret_env out: adding HF_TOKEN
  changes the process's environment, and a name reveals nothing secret.
- the profile's name does not count: renaming changes no process.

This module must NOT hash anything but the profile: placement (GPUs, ports)
changes which shard runs where, not what a shard runs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NewType

from llmgw.engines.spec import Profile

__all__ = [
    "FINGERPRINT_EXCLUDED",
    "FINGERPRINT_FIELDS",
    "ProfileFingerprint",
    "profile_fingerprint",
]

ProfileFingerprint = NewType("ProfileFingerprint", str)

# Every Profile field is in exactly one of these two (a test holds it so), so
# a new field forces a decision instead of silently staying out.
FINGERPRINT_FIELDS = (
    "engine",
    "model_path",
    "served_model_name",
    "gpu_class",
    "tp",
    "pp",
    "gpus_per_node",
    "nodes",
    "args",
    "env",
    "adapters",
    "kv_events",
    "threads",
    "kv_hash",
    "multinode_backend",
)
FINGERPRINT_EXCLUDED = ("name", "secret_env")


def _canonical(profile: Profile) -> dict[str, Any]:
    dumped = profile.model_dump(mode="json")
    view = {f: dumped[f] for f in FINGERPRINT_FIELDS}
    # Spellings of one launch hash alike: pp 0 is PP 1, gpus_per_node 0 is
    # TP x PP, an empty served name is the model path (spec.py).
    view.update(
        pp=profile.pp_degree,
        nodes=profile.num_nodes,
        gpus_per_node=profile.per_node,
        served_model_name=profile.served_name,
    )
    view["secret_env_names"] = sorted(profile.secret_env)
    # Versioned so a deliberate change of this function is visible as one.
    view["v"] = 1
    return view


def profile_fingerprint(profile: Profile) -> ProfileFingerprint:
    """Hex SHA-256 of the canonical JSON of the profile's launch-relevant fields."""
    text = json.dumps(
        _canonical(profile), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return ProfileFingerprint(hashlib.sha256(text.encode("utf-8")).hexdigest())
