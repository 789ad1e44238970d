"""The reconciler's I/O shell (docs/architecture.md §4): the leader's lock and epoch (``leader.py``) and the
loop that loads a snapshot, plans with the pure ``llmgw.planner`` and applies
the plan fenced by the epoch (``loop.py``). Its SQL lives in ``llmgw.store``."""
