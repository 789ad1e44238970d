"""The control plane: the fleet's brain, served on the internal listener.

What it holds::

    internal_app.py  the internal listener's app: health, readiness, docs, admin and agent APIs,
                     the web console
    admin            the admin API: one router per resource (mounted by admin/api.py; request
                     and response bodies in admin/schemas.py)
    agentapi         the agent API: registration, sync, heartbeats and KV-delta intake
    console          the operator's web console at /ui
    reconcile        the reconciler's shell: the leader's lock and epoch, the loop, its snapshot
                     read and its plan's writes (the pure planner is ``llmgw.planner``)
    instances.py     this process's row among the live control plane instances
    profile_checks   pure: what a profile must pass before it is stored

It never imports ``llmgw.gateway`` (the public OpenAI listener): both sit on ``llmgw.store``,
``llmgw.kv``, ``llmgw.http`` and ``llmgw.config``, and ``llmgw.serve`` builds the process from
the two (docs/packages.md).
"""
