"""The node agent (`llmgw agent`): one per machine (design §1, §4, §5).

Discovers the node (inventory/), registers with the control plane and pulls
its desired shard set (sync.py, client.py over llmgw.protocol), runs each
shard under a `llmgw shard-run` wrapper (shardrun.py) and supervises them
(diff.py, the pure core; supervisor.py, the shell), adopting running engines
after its own restart (records.py, procs.py). Local policy and secrets are
resolved here (policy.py, secrets.py, prepare.py).

It must NOT import llmgw.controlplane: the two share only llmgw.protocol.
Submodules are imported by name; this package re-exports nothing so that
`llmgw shard-run` stays light.
"""

__all__: list[str] = []
