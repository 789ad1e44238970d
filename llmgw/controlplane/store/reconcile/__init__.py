"""The reconciler's SQL, one pass's two halves.

``load_snapshot`` (``read.py``) reads desired and observed state in a constant number of
statements and turns the rows into the planner's frozen views; ``apply_plan`` (``write.py``)
writes a plan's actions in the caller's epoch-fenced transaction. Neither decides anything:
the pure planner (``llmgw.controlplane.planner``) does, its rules for reading rows included.
"""

from llmgw.controlplane.store.reconcile.read import LoadedState, NodeFacts, load_snapshot
from llmgw.controlplane.store.reconcile.write import ACTION_LOG_KEEP, apply_plan, apply_scale

__all__ = [
    "ACTION_LOG_KEEP",
    "LoadedState",
    "NodeFacts",
    "apply_plan",
    "apply_scale",
    "load_snapshot",
]
