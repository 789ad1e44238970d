"""The agent-facing side of the control plane: registration, sync and KV-delta intake.

Submodules are imported by their own names (``llmgw.controlplane.agentapi.kv_intake``) so that
importing one does not drag in the others' dependencies. Nothing here imports the node agent:
the two sides share only ``llmgw.protocol``.
"""

__all__: list[str] = []
