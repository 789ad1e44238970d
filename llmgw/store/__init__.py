"""The state store: the schema, connections, migrations, and every SQL statement of the
control plane, one module per subject.

    tables, database, migrations   the schema, the engine and sessions, Alembic
    dedicated, notify              dedicated connections; the process's one LISTEN connection
    catalog                        models, profiles, deployments, the audit log; the one
                                   get-by-name of every named table (one_by_name)
    adapters                       declared adapters (`kind: adapter`)
    runtime_adapters               their placement: shards' desired adapters, adapter_status,
                                   the status the admin API reads back
    namespace                      the names clients send as `model`, read under one lock
    fleet                          the admin's nodes, replicas, action record, GPU classes
    bootstrap_tokens               bootstrap tokens: created, listed, revoked, consumed
    credentials                    node credentials and API keys: their shapes and hashes
    agent_nodes, agent_shards      the agent API: registration, sync, heartbeats, bindings
    tokenizers                     models' tokenizer files, shipped by agents
    instances                      controlplane_instances: this process and the live ones
    discovery                      the engines Prometheus discovery lists
    keys, usage, routes            API keys, usage accounting, the gateway's route table
    demand                         the gateways' per-model demand the autoscaler reads
    bulk                           rows for a bulk statement as one JSONB parameter

The reconcile pass's snapshot read and its plan's writes are the reconciler's own
(``llmgw.controlplane.reconcile.read`` and ``.write``).

The subjects' functions take a session and never commit: their caller owns the transaction.
What this package must NOT do: decide policy (the planner, the admin and agent APIs do) or format
HTTP; errors are ``llmgw.errors`` types.
"""
