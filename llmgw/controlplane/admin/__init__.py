"""The admin API's routers, one per resource, over the shared machinery in ``common``.

``llmgw.controlplane.admin.api`` assembles them into the one ``admin_router`` the app
mounts. Nothing here opens a transaction of its own except through ``common.Session`` (or,
for ``apply``, the session factory, since a dry run must roll back).
"""

from __future__ import annotations

__all__: list[str] = []
