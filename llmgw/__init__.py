"""llmgw: a fleet manager for LLM inference engines, with a built-in simulator engine.

    gateway            the public OpenAI listener: keys, limits, routing (pure: gateway.routing),
                       the upstream relay
    controlplane       the internal listener: admin and agent APIs, console, the reconciler
    serve              the control plane process: both listeners built from shared parts
    store              Postgres: tables, migrations, every query, LISTEN/NOTIFY
    planner            pure: the reconciler's core (placement, the plan, autoscaling)
    http               what every listener shares: head and body caps, errors, request log
    nodeagent          `llmgw agent`: one per machine, starts and supervises the engines
    engines            pure: from a profile and a shard spec to the exact processes to start
    kv                 pure: KV-cache block hashing, event codec, block mirror, prefix index
    protocol           the wire models the agent and the control plane share
    simengine          `llmgw simengine`: a real engine process without a GPU
    up                 `llmgw up`: the whole system on one machine
    embedded_postgres  a private PostgreSQL server (`llmgw up`, the tests)
    commands, cli.py   the `llmgw` command and its subcommands
    config             the settings tree and its loader

Shared leaves: errors.py (the error tree), logs.py, eventloop.py (the loop, and stopping its tasks), documents.py (YAML documents).
"""
