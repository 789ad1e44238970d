"""The control plane (`llmgw controlplane`): one process serving two listeners.

What it holds::

    store            the tables, the database, migrations and every query
    planner          the reconciler's pure core: placement and the plan
    reconcile        the reconciler's shell: the leader's lock and the loop applying the plan
    admin            the admin API's routers (assembled by admin_api.py; bodies in schemas.py)
    agentapi         the agent API: registration, sync and KV-delta intake
    gateway          the OpenAI gateway: keys, limits, routing, the upstream relay
    http             ASGI pieces both listeners share: errors, request log, admin auth, body caps
    internal_app.py  the internal listener's app: health, readiness, admin and agent APIs
    public_app.py    the public listener's app: the gateway, wired
    server.py        both listeners' uvicorn servers on one loop, with one shutdown
"""
