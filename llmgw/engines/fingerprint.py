"""A profile's fingerprint: which version of a profile a running shard was started from.

The control plane stores it with each shard and rolls replicas whose
fingerprint differs from the catalog's (docs/architecture.md §3). It must change exactly
when the launched processes or their placement would change (issue 8 item
10: with kv_events off, a new KV hash seed changed it though no command did,
and would have rolled every replica). So it is not a hash of profile fields
but of what the adapter makes of them:

- the commands (program, argv, complete environment, files) the engine's
  adapter builds for every rank of the profile on one fixed, canonical
  placement (`_canonical_spec`: fixed ports, GPU indices 0..n-1, fixed
  addresses, an empty base environment), and
- the placement requirements (GPU class, nodes, GPUs and threads per node,
  MIG and uniformity constraints), which decide where those processes run.

"Equal" is therefore: equal commands and environments on that placement plus
equal requirements. Secret values never enter it: the API key and every
secret_env value are fixed placeholders, so editing a secret rolls nothing
and no hash of a low-entropy secret leaks; secret_env *names* do count,
since the process gets those variables. The profile's name does not count.
Canonical JSON (sorted keys, no whitespace) keeps a YAML or JSON source's
formatting and key order out of it. A property test over every adapter
holds the rule (tests/engines/test_engines_fingerprint.py).

This module must NOT hash placement choices (which GPUs, ports, nodes): they
change where a shard runs, not what it runs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any, NewType

from llmgw.engines.registry import reference_engine
from llmgw.engines.requirements import placement_requirements
from llmgw.engines.spec import Profile, ReplicaId, ShardId, ShardSpec

__all__ = ["FINGERPRINT_VERSION", "ProfileFingerprint", "profile_fingerprint"]

ProfileFingerprint = NewType("ProfileFingerprint", str)

# Bumped when this function changes on purpose, so the change shows as one.
FINGERPRINT_VERSION = 2
_API_KEY = "<api-key>"
_SECRET = "<secret>"


def _canonical_spec(profile: Profile, rank: int, gpus: int) -> ShardSpec:
    nnodes = profile.num_nodes
    multi = nnodes > 1
    return ShardSpec(
        replica_id=ReplicaId("fingerprint"),
        shard_id=ShardId(f"fingerprint-{rank}"),
        rank=rank,
        nnodes=nnodes,
        leader_addr="10.0.0.1" if multi else "",
        leader_port=29500 if multi else 0,
        gpu_indices=tuple(range(gpus)),
        hcas=("mlx5_0",) if multi else (),
        mgmt_interface="eth0" if multi else "",
        fabric="ib:fingerprint" if multi else "",
        http_port=8000,
        profile=profile,
        node_addr=f"10.0.0.{rank + 1}" if multi else "",
        peer_addrs=tuple(f"10.0.0.{r + 1}" for r in range(nnodes)) if multi else (),
        api_key=_API_KEY,
        secret_env={name: _SECRET for name in profile.secret_env},
        kv_events_port=5557 if profile.kv_events else 0,
        runtime_dir="/run/llmgw/fingerprint",
    )


def _canonical(profile: Profile) -> dict[str, Any]:
    engine = reference_engine(profile.engine)
    req = placement_requirements(profile)
    ranks = [
        [
            c.to_json_dict()
            for c in engine.commands(_canonical_spec(profile, rank, req.gpus_per_node), base_env={})
        ]
        for rank in range(req.nodes)
    ]
    return {"v": FINGERPRINT_VERSION, "placement": asdict(req), "ranks": ranks}


def profile_fingerprint(profile: Profile) -> ProfileFingerprint:
    """Hex SHA-256 of the canonical commands and placement of the profile.

    Raises SpecError for a profile its engine refuses: only a launchable
    profile has a version worth recording.
    """
    text = json.dumps(
        _canonical(profile), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return ProfileFingerprint(hashlib.sha256(text.encode("utf-8")).hexdigest())
