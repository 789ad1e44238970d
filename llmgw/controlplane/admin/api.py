"""The admin API under /admin/v1: one router per resource, assembled into ``admin_router``.

The routers live in ``llmgw.controlplane.admin``: models, profiles, declared adapters and
deployments (desired state), nodes, bootstrap tokens, replicas (read-only), the reconciler's actions
(read-only), GPU classes, the gateway's API keys and usage, and ``apply`` (many documents,
all or nothing). What they share (authentication, the per-request transaction, pages,
audited writes that wake the reconciler) is ``llmgw.controlplane.admin.common``.

Authentication is the admin bearer token, compared in constant time; ``AdminAuth`` checks
it before the body is read, and the router's dependency checks it again, so a route
mounted without that middleware is still never open. Lists are pages,
``{"items": [...], "next_cursor": ...}`` (``?limit=``, default 100, at most 1000;
``?cursor=`` from the previous page). A name in a path is checked as a name in a body is.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from llmgw.controlplane.admin import (
    actions,
    adapters,
    apply,
    debug_kv,
    demand,
    deployments,
    discovery,
    gpu_classes,
    keys,
    models,
    nodes,
    profiles,
    replicas,
    tokens,
    usage,
)
from llmgw.controlplane.admin.common import DEFAULT_PAGE, ERRORS, MAX_PAGE, require_admin

__all__ = ["DEFAULT_PAGE", "MAX_PAGE", "admin_router"]

admin_router = APIRouter(
    prefix="/admin/v1", responses=ERRORS, dependencies=[Depends(require_admin)]
)
for _module in (
    models,
    profiles,
    adapters,
    deployments,
    nodes,
    tokens,
    replicas,
    actions,
    gpu_classes,
    apply,
    debug_kv,
    keys,
    usage,
    demand,
    discovery,
):
    admin_router.include_router(_module.router)
