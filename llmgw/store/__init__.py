"""The state store: the schema, connections, migrations, and every SQL statement of the
control plane, one module per subject.

    tables, database, migrations   the schema, the engine and sessions, Alembic
    dedicated, notify              dedicated connections; the process's one LISTEN connection
    catalog                        models, profiles, deployments, the audit log
    fleet                          the admin's nodes, replicas, action record, GPU classes
    bootstrap_tokens               bootstrap tokens: created, listed, revoked, consumed
    agent_nodes, agent_shards      the agent API: registration, sync, heartbeats, bindings
    reconcile                      the reconcile pass: its snapshot read and its plan's writes
    instances                      controlplane_instances: this process and the live ones
    discovery                      the engines Prometheus discovery lists
    keys, usage, routes            API keys, usage accounting, the gateway's route table
    bulk                           rows for a bulk statement as one JSONB parameter

The subjects' functions take a session and never commit: their caller owns the transaction.
What this package must NOT do: decide policy (the planner, the admin and agent APIs do) or format
HTTP; errors are ``llmgw.errors`` types.
"""
