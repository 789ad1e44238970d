"""The agent-facing side of the control plane: registration, sync and KV-delta intake.

Submodules are imported by their own names (``llmgw.kv.shard_views``) so that
importing one does not drag in the others' dependencies. Nothing here imports the node agent:
the two sides share only ``llmgw.protocol``.

Version skew policy (agents and control planes are upgraded one machine at a time, so for a
while both versions run against each other and against one database):

* Agents one minor release behind (or ahead) keep working. ``PROTOCOL_VERSION`` is bumped
  only for a change an older peer cannot ignore; a minor release adds optional fields with
  defaults and never changes a field's meaning. Every wire model ignores fields it does not
  know (``extra="ignore"``), so a newer agent's additions are dropped here and a newer
  control plane's additions are dropped by an older agent; an older agent's request without
  a newer field gets the default. A request naming another protocol version is refused with
  426 and a message saying to upgrade the older side, never half-understood.
  (tests/e2e/test_version_skew.py holds a real process to this.)
* Migrations are expand-then-contract, so a rolling upgrade of control planes never breaks
  the older ones still serving: release N adds (new tables, nullable or defaulted columns,
  new constraints that old writers satisfy) and writes both shapes; release N+1 stops reading
  the old shape; only release N+2 drops it. A migration never renames or retypes a column in
  place, and ``llmgw db upgrade`` is safe to run while release N-1 processes serve.
* Launch specs travel as JSON objects, not as ``llmgw.engines.ShardSpec``: a spec an older
  agent cannot parse fails that shard (reported), never the whole sync.
"""

__all__: list[str] = []
