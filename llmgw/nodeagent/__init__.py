"""The node agent (`llmgw agent`): one per machine (docs/architecture.md §1, §4, §5).

Discovers the node (inventory/), registers with the control plane and pulls
its desired shard set (sync.py, client.py over llmgw.protocol), runs each
shard under a `llmgw shard-run` wrapper (shardrun.py) and supervises them
(diff.py, the pure core; supervisor.py, the shell, with supervisor_config.py:
launch.py starts and stops shards, exits.py reads their ends, health.py probes
them, shardprocs.py tells whether a wrapper runs), adopting running engines after its own
restart (records.py, procs.py, runtime.py). Local policy and secrets are resolved here
(policy.py, secrets.py, prepare.py, adapters.py, ports.py). Each leader engine is exposed
through its front door, an authenticating proxy (proxy.py) its wrapper serves
(frontdoor.py; leaders of older wrappers through the agent's shared_proxy.py), its KV events
relayed to the control plane (kvrelay/, wired by kv_wiring.py), its tokenizer files
shipped (tokenizer_ship.py) and its runtime LoRA adapters converged to the leader's placement
(adapter_diff.py, the pure core; adapter_sync.py, the shell). agent.py composes it all: its settings checked
(agent_validation.py) and translated (agent_settings.py), the node read (agent_inventory.py);
state.py keeps its identity and metrics.py its /metrics and /healthz.

It must NOT import llmgw.controlplane: the two share only llmgw.protocol.
Submodules are imported by name; this package re-exports nothing so that
`llmgw shard-run` stays light.
"""

__all__: list[str] = []
