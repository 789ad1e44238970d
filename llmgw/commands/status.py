"""`llmgw status [--json]`: the fleet on one screen: nodes, deployments (desired / ready /
updated replicas, rollout progress), shards with state and reason, runtime adapters (desired
/ loaded replicas, why one is short, failed loads), and the prefix-routing hit rate per model.

It connects as `llmgw get` does (--url / LLMGW_ADMIN_URL, else the up.json of a local
`llmgw up`). The hit rate comes from the control plane's own /metrics
(``llmgw_prefix_decisions_total``): it counts the decisions of the one control plane
answering, since its start; behind a load balancer each instance counts its own.

What it must not do: write anything, or read more than a bounded number of pages.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import httpx
import typer

from llmgw.commands._admin_client import (
    AdminClient,
    AdminConnection,
    DataDirOption,
    TokenOption,
    UrlOption,
    resolve_connection,
)
from llmgw.commands._common import exit_on_error
from llmgw.commands.tables import render_table
from llmgw.controlplane.console.fleet_view import node_state, prefix_hit_rates, rollout_text
from llmgw.errors import LlmgwError

__all__ = ["collect", "prefix_hit_rates", "render", "status", "tokenizer_modes"]

_DECISIONS = "llmgw_prefix_decisions"


def _metrics(conn: AdminConnection) -> dict[str, dict[str, Any]] | None:
    """None when the control plane publishes no routing decisions (an older one) or its
    /metrics cannot be read."""
    try:
        r = httpx.get(
            f"{conn.url}/metrics", headers={"Authorization": f"Bearer {conn.token}"}, timeout=10
        )
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or _DECISIONS not in r.text:
        return None
    rates = prefix_hit_rates(r.text)
    for model, mode in tokenizer_modes(r.text).items():
        if model in rates:
            rates[model]["tokenizer"] = mode
    return rates


def tokenizer_modes(metrics_text: str) -> dict[str, str]:
    """Per model, how precise routing tokenizes its prompts (``llmgw_prefix_tokenizer_mode``:
    local, remote or none), and why where local is off: "remote (profile)" where a profile says
    ``tokenizer: none`` (``llmgw_prefix_tokenizer_profile_none``), "remote (failing: <why>)"
    where failures turned it off (``llmgw_prefix_tokenizer_failing``), else "remote
    (mismatch)" where a verification turned local off."""
    from prometheus_client.parser import text_string_to_metric_families

    modes: dict[str, str] = {}
    mismatched: set[str] = set()
    by_profile: set[str] = set()
    failing: dict[str, str] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            model = sample.labels.get("model", "")
            if family.name == "llmgw_prefix_tokenizer_mode" and sample.value == 1:
                modes[model] = sample.labels.get("mode", "")
            elif sample.name == "llmgw_prefix_tokenizer_mismatches_total" and sample.value > 0:
                mismatched.add(model)
            elif sample.name == "llmgw_prefix_tokenizer_profile_none" and sample.value == 1:
                by_profile.add(model)
            elif sample.name == "llmgw_prefix_tokenizer_failing" and sample.value == 1:
                failing[model] = sample.labels.get("reason", "")
    out: dict[str, str] = {}
    for m, mode in modes.items():
        if mode == "remote" and m in by_profile:
            mode = "remote (profile)"
        elif mode == "remote" and m in failing:
            mode = f"remote (failing: {failing[m]})"
        elif mode == "remote" and m in mismatched:
            mode = "remote (mismatch)"
        out[m] = mode
    return out


def collect(client: AdminClient, conn: AdminConnection) -> dict[str, Any]:
    """Everything the screen shows, as the --json output."""
    nodes = client.list_all("nodes")
    deployments = client.list_all("deployments")
    replicas = client.list_all("replicas")
    shards = []
    for rep in replicas:
        for s in rep.get("shards") or []:
            shards.append(
                {
                    "deployment": rep.get("deployment"),
                    "replica": rep.get("id"),
                    "replica_state": rep.get("state"),
                    "stale": rep.get("stale"),
                    "id": s.get("id"),
                    "node": s.get("node"),
                    "rank": s.get("rank"),
                    "gpus": [g.get("mig_uuid") or g.get("index") for g in s.get("gpus") or []],
                    "desired_state": s.get("desired_state"),
                    "state": s.get("observed_state"),
                    "reason": s.get("reason"),
                    "restarts": s.get("restarts"),
                }
            )
    out_deployments = []
    for d in deployments:
        st = d.get("status") or {}
        desired = int(d.get("replicas") or 0)
        updated = int(st.get("updated_replicas") or 0)
        out_deployments.append(
            {
                "name": d.get("name"),
                "model": d.get("model"),
                "profile": d.get("profile"),
                "state": d.get("state"),
                "desired": desired,
                "ready": int(st.get("ready_replicas") or 0),
                "updated": updated,
                "existing": int(st.get("replicas") or 0),
                "rollout": rollout_text(d),
                "stalled": bool(st.get("stalled")),
                "reason": st.get("reason") or "",
                "suspended": int(st.get("suspended_replicas") or 0),
                "autoscale": _autoscale(d),
            }
        )
    rates = _metrics(conn)
    now = datetime.now(UTC)
    return {
        "adapters": _adapters(client),
        "demand": _demand(client),
        "nodes": [
            {
                "name": n.get("name"),
                "approval": n.get("approval_state"),
                "pool": n.get("pool"),
                "gpus": n.get("num_gpus"),
                "free_gpus": n.get("free_gpus"),
                "shards": n.get("num_shards"),
                "cordoned": n.get("cordoned"),
                "draining": n.get("draining"),
                "last_sync_at": n.get("last_sync_at"),
                "state": _node_state(n.get("approval_state"), n, now),
            }
            for n in nodes
        ],
        "deployments": out_deployments,
        "shards": shards,
        "prefix_routing": rates,
    }


def _autoscale(d: dict[str, Any]) -> dict[str, Any] | None:
    """An autoscaled deployment's policy bounds and the leader's last decision; None: fixed."""
    policy = d.get("autoscale")
    if not isinstance(policy, dict):
        return None
    last = d.get("autoscale_status") or {}
    return {
        "min": policy.get("min_replicas"),
        "max": policy.get("max_replicas"),
        "desired": last.get("desired_replicas", d.get("replicas")),
        "warm": last.get("warm_replicas", d.get("replicas")),
        "last_scaled_at": last.get("last_scaled_at"),
        "reason": last.get("reason") or "",
    }


def _adapters(client: AdminClient) -> list[dict[str, Any]] | None:
    """Declared adapters and where they stand; None from a control plane that predates them."""
    try:
        items = client.list_all("adapters")
    except LlmgwError:
        return None
    out = []
    for a in items:
        raw = a.get("status")
        st: dict[str, Any] = raw if isinstance(raw, dict) else {}
        failures = [f for f in st.get("failures") or [] if isinstance(f, dict)]
        out.append(
            {
                "name": a.get("name"),
                "model": a.get("model"),
                "desired": st.get("desired_replicas"),
                "replicas": len(st.get("replicas") or []),
                "loaded": len(st.get("loaded") or []),
                "unplaced": st.get("unplaced") or "",
                "failures": [
                    {
                        "replica": f.get("replica"),
                        "node": f.get("node"),
                        "reason": f.get("reason") or "",
                        "failures": f.get("failures") or 0,
                    }
                    for f in failures
                ],
            }
        )
    return out


def _adapter_reason(a: dict[str, Any]) -> str:
    """Why an adapter is short, then each failed load (node, count, reason)."""
    parts = [a["unplaced"]] if a.get("unplaced") else []
    parts += [
        f"load failed on {f['node']} ({f['failures']}x): {f['reason']}" for f in a["failures"]
    ]
    return "; ".join(parts)


def _demand(client: AdminClient) -> list[dict[str, Any]] | None:
    """The gateways' per-model demand; None from a control plane that predates it."""
    try:
        reply = client.request("GET", "/demand")
    except LlmgwError:
        return None
    items = reply.get("items") if isinstance(reply, dict) else None
    return items if isinstance(items, list) else None


def _node_state(approval: Any, n: dict[str, Any], now: datetime) -> str:
    """The console's judgement of a node (``fleet_view.node_state``): one rule on both screens."""
    return node_state(
        approval=approval,
        cordoned=n.get("cordoned"),
        draining=n.get("draining"),
        last_sync_at=n.get("last_sync_at"),
        now=now,
    )


def _age(ts: Any) -> str:
    if not isinstance(ts, str):
        return "never"
    try:
        at = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return ts
    seconds = (datetime.now(UTC) - at.astimezone(UTC)).total_seconds()
    return f"{max(seconds, 0):.0f}s ago"


def _short(text: Any, width: int) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= width else s[: width - 1] + "…"


def render(data: dict[str, Any]) -> str:
    """The one screen for a person."""
    parts = [f"NODES ({len(data['nodes'])})"]
    parts.append(
        render_table(
            ["NAME", "APPROVAL", "POOL", "GPUS FREE/ALL", "SHARDS", "STATE", "LAST SYNC"],
            [
                [
                    n["name"],
                    n["approval"],
                    n["pool"],
                    f"{n['free_gpus']}/{n['gpus']}",
                    n["shards"],
                    n.get("state") or _node_state(n.get("approval"), n, datetime.now(UTC)),
                    _age(n["last_sync_at"]),
                ]
                for n in data["nodes"]
            ],
        )
    )
    parts.append(f"\nDEPLOYMENTS ({len(data['deployments'])})")
    parts.append(
        render_table(
            ["NAME", "MODEL", "DESIRED", "READY", "UPDATED", "ROLLOUT", "REASON"],
            [
                [
                    d["name"],
                    d["model"],
                    d["desired"],
                    d["ready"],
                    d["updated"],
                    d["rollout"],
                    _short(d["reason"], 60),
                ]
                for d in data["deployments"]
            ],
        )
    )
    parts.append(f"\nSHARDS ({len(data['shards'])})")
    parts.append(
        render_table(
            ["DEPLOYMENT", "REPLICA", "RANK", "NODE", "GPUS", "STATE", "RESTARTS", "REASON"],
            [
                [
                    s["deployment"],
                    _short(s["replica"], 9)
                    + (" (stale)" if s["stale"] else "")
                    + ("" if s["replica_state"] == "active" else f" ({s['replica_state']})"),
                    s["rank"],
                    s["node"],
                    ",".join(str(g) for g in s["gpus"]),
                    s["state"]
                    if s["desired_state"] in ("running", None)
                    else f"{s['state']} (want {s['desired_state']})",
                    s["restarts"],
                    _short(s["reason"], 50),
                ]
                for s in data["shards"]
            ],
        )
    )
    adapters = data.get("adapters")
    if adapters:
        parts.append(f"\nADAPTERS ({len(adapters)})")
        parts.append(
            render_table(
                ["NAME", "MODEL", "DESIRED", "PLACED", "LOADED", "REASON"],
                [
                    [
                        a["name"],
                        a["model"],
                        "-" if a["desired"] is None else a["desired"],
                        a["replicas"],
                        a["loaded"],
                        _short(_adapter_reason(a), 80) or "-",
                    ]
                    for a in adapters
                ],
            )
        )
    demand = data.get("demand")
    scaled = [d for d in data["deployments"] if d.get("autoscale")]
    if scaled:
        held = {m["model"]: m.get("held", 0) for m in demand or []}
        parts.append(f"\nAUTOSCALING ({len(scaled)})")
        parts.append(
            render_table(
                ["NAME", "MIN..MAX", "DESIRED", "READY", "SUSPENDED", "HELD", "LAST", "REASON"],
                [
                    [
                        d["name"],
                        f"{d['autoscale']['min']}..{d['autoscale']['max']}",
                        d["autoscale"]["desired"],
                        d["ready"],
                        d["suspended"],
                        held.get(d["model"], 0),
                        _age(d["autoscale"]["last_scaled_at"])
                        if d["autoscale"]["last_scaled_at"]
                        else "-",
                        _short(d["autoscale"]["reason"], 70),
                    ]
                    for d in scaled
                ],
            )
        )
    if demand:
        parts.append("\nGATEWAY DEMAND (every gateway reporting)")
        parts.append(
            render_table(
                [
                    "MODEL",
                    "STATE",
                    "QUEUED",
                    "HELD",
                    "IN FLIGHT",
                    "PREFILL",
                    "UNCACHED",
                    "SHED",
                    "SATURATED FOR",
                ],
                [
                    [
                        m["model"],
                        "saturated" if m.get("saturated") else "ok",
                        m.get("queued", 0),
                        m.get("held", 0),
                        m.get("in_flight", 0),
                        m.get("queued_prefill_tokens", 0),
                        m.get("uncached_prefill_tokens", 0),
                        m.get("shed", 0),
                        _age(m.get("saturated_since")) if m.get("saturated") else "-",
                    ]
                    for m in demand
                ],
            )
        )
    parts.append("\nPREFIX ROUTING (this control plane, since it started)")
    rates = data["prefix_routing"]
    if rates is None:
        parts.append("n/a: this control plane publishes no llmgw_prefix_decisions_total")
    elif not rates:
        parts.append("no requests routed yet")
    else:
        parts.append(
            render_table(
                ["MODEL", "DECISIONS", "PREFIX HITS", "HIT RATE", "PRECISE", "TOKENIZING"],
                [
                    [
                        m,
                        r["decisions"],
                        r["hits"],
                        "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%",
                        r["precise"],
                        r.get("tokenizer", "-"),
                    ]
                    for m, r in sorted(rates.items())
                ],
            )
        )
    return "\n".join(parts)


@exit_on_error
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Show the fleet on one screen: nodes, deployments and rollouts, shards and why they are
    not ready, runtime adapters and where they are loaded, and the prefix-routing hit rate per
    model."""
    conn = resolve_connection(url, admin_token, data_dir)
    with AdminClient(conn) as client:
        data = collect(client, conn)
    typer.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else render(data))
