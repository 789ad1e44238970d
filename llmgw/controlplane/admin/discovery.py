"""``/admin/v1/discovery/prometheus``: Prometheus HTTP service discovery of engine metrics.

The answer is Prometheus' ``http_sd`` format: a JSON list of target groups, one per ready
engine (the leader shard, rank 0, of a replica, as its agent reports it), each with
one target, the agent's authenticating proxy (``host:port`` of the shard's ``proxy_url``),
and labels::

    [{"targets": ["10.0.0.7:9401"],
      "labels": {"__metrics_path__": "/shards/<shard id>/metrics", "__scheme__": "http",
                 "model": "chat", "deployment": "chat", "replica": "<id>",
                 "shard": "<id>", "node": "gpu-07"}}]

Only ready, unreleased shards that are desired running are listed: an engine that is
starting, failed or being stopped has no metrics worth a scrape, and a target that
disappears when its replica is removed is what Prometheus expects of service discovery.

Authentication, and why it is not in the answer: the proxy demands each shard's own engine
key (``Authorization: Bearer``), and ``http_sd`` cannot carry per-target credentials; only
labels, which Prometheus stores with every sample and shows on its targets page, and which
relabeling cannot turn into a header. Engine keys are secrets (never returned by this API,
never logged), so they are not put there. The scheme chosen is one credential per scrape
job: a fleet-wide, read-only metrics token that the agent proxy accepts for
``GET /shards/<id>/metrics`` and nothing else, which Prometheus sends with
``authorization: {credentials_file: ...}``. That acceptance is the agent's half: set
``agent.metrics_token_file`` on every node to a file holding the token (16+ characters);
an agent without it answers scrapes 401, so they show as down, never as open::

    scrape_configs:
      - job_name: llmgw-engines
        http_sd_configs:
          - url: http://cp-1.mgmt:8081/admin/v1/discovery/prometheus
            authorization: {credentials_file: /etc/prometheus/llmgw-admin-token}
        authorization: {credentials_file: /etc/prometheus/llmgw-metrics-token}

The discovery request itself is an admin API call (the admin token), like every route here:
the list names nodes and addresses, which only operators should read.

This module must NOT return or log engine keys.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter

from llmgw.controlplane.admin.common import Session
from llmgw.store.discovery import metrics_targets

__all__ = ["prometheus_targets", "router", "target_group"]

router = APIRouter(tags=["discovery"])


def target_group(
    *, proxy_url: str, model: str, deployment: str, replica: str, shard: str, node: str
) -> dict[str, Any] | None:
    """One http_sd target group for a ready shard; None when its proxy URL is not usable."""
    parts = urlsplit(proxy_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        # An agent that reported no proxy address cannot be scraped; listing it would only
        # show up as a failing target.
        return None
    return {
        "targets": [parts.netloc],
        "labels": {
            "__metrics_path__": parts.path.rstrip("/") + "/metrics",
            "__scheme__": parts.scheme,
            "model": model,
            "deployment": deployment,
            "replica": replica,
            "shard": shard,
            "node": node,
        },
    }


@router.get("/discovery/prometheus")
async def prometheus_targets(session: Session) -> list[dict[str, Any]]:
    """Ready engines' metrics targets in Prometheus' http_sd format (one group per engine)."""
    groups = []
    for t in await metrics_targets(session):
        group = target_group(
            proxy_url=t.proxy_url,
            model=t.model,
            deployment=t.deployment,
            replica=str(t.replica_id),
            shard=str(t.shard_id),
            node=t.node,
        )
        if group is not None:
            groups.append(group)
    return groups
