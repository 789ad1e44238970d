"""The `--kv-events-config` value shared by vLLM and the simulator (docs/architecture.md §6).

This module must NOT choose ports: the agent allocates them and reports them
in the shard's binding.
"""

from __future__ import annotations

import json

from llmgw.engines.spec import ShardSpec

__all__ = ["kv_events_config", "kv_events_topic"]


def kv_events_topic(spec: ShardSpec) -> str:
    # The agent drops frames of any other topic: a stopping engine's PUB may
    # reconnect to a port the agent has since given to another shard.
    return f"kv@{spec.shard_id}"


def kv_events_config(spec: ShardSpec) -> str:
    """Compact JSON with sorted keys, so the command line is deterministic.

    The PUB endpoint has no `*`, so the engine connects to the agent's bound
    SUB socket; the replay ROUTER is the engine's and binds on loopback.
    """
    cfg: dict[str, object] = {
        "enable_kv_cache_events": True,
        # Unset meant the null publisher up to vLLM 0.13.
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{spec.kv_events_port}",
        "topic": kv_events_topic(spec),
    }
    if spec.kv_replay_port:
        cfg["replay_endpoint"] = f"tcp://127.0.0.1:{spec.kv_replay_port}"
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))
