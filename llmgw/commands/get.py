"""`llmgw get KIND [NAME]`: read objects from the admin API, as a table (like kubectl), JSON or YAML."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Annotated, Any
from urllib.parse import quote

import typer

from llmgw.commands import tables
from llmgw.commands._admin_client import (
    DataDirOption,
    TokenOption,
    UrlOption,
    admin_client,
)
from llmgw.commands._common import exit_on_error, fail

__all__ = ["get", "render_table"]


class Output(StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"


def _short(value: Any, width: int = 12) -> str:
    text = "-" if value is None or value == "" else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _status(item: dict[str, Any], key: str) -> Any:
    status = item.get("status") or {}
    return status.get(key, "-") if isinstance(status, dict) else "-"


def _gpus(item: dict[str, Any]) -> str:
    """free/placeable: the API counts MIG instances, not the GPUs they are carved from."""
    total = item.get("num_gpus")
    if total is None:
        inventory = item.get("inventory") or {}
        total = len(inventory.get("gpus") or [] if isinstance(inventory, dict) else [])
    free = item.get("free_gpus")
    return f"{free}/{total}" if free is not None else str(total)


def _adapter_replicas(item: dict[str, Any]) -> str:
    """An adapter's replicas as DESIRED/LOADED: how many should hold it (the leader's count;
    "-" before it placed it) and how many report it loaded."""
    status = item.get("status")
    if not isinstance(status, dict):
        return "-"
    desired = status.get("desired_replicas")
    loaded = status.get("loaded")
    return f"{'-' if desired is None else desired}/{len(loaded) if isinstance(loaded, list) else 0}"


def _uses(item: dict[str, Any]) -> str:
    return "unlimited" if item.get("uses_left") is None else str(item["uses_left"])


# kind -> (columns: header and how to read it from one item)
_Column = tuple[str, Callable[[dict[str, Any]], Any]]
_TABLES: dict[str, list[_Column]] = {
    "models": [
        ("NAME", lambda i: i.get("name")),
        ("DESCRIPTION", lambda i: _short(i.get("description"), 40)),
    ],
    "profiles": [
        ("NAME", lambda i: i.get("name")),
        ("MODEL", lambda i: i.get("model")),
        ("ENGINE", lambda i: i.get("engine")),
        ("GPU CLASS", lambda i: i.get("gpu_class") or "-"),
        ("TP", lambda i: i.get("tp")),
        ("PP", lambda i: i.get("pp")),
        ("NODES", lambda i: i.get("nodes")),
        ("FINGERPRINT", lambda i: _short(i.get("fingerprint"), 12)),
    ],
    # Declared adapters (`kind: adapter`): MIN/MAX "-" is the default; DESIRED/LOADED is the
    # placement's (the item's `status`; `llmgw status` says why one is short).
    "adapters": [
        ("NAME", lambda i: i.get("name")),
        ("MODEL", lambda i: i.get("model")),
        ("PATH", lambda i: _short(i.get("path"), 40)),
        ("MIN", lambda i: i.get("min_replicas")),
        ("MAX", lambda i: i.get("max_replicas")),
        ("PINNED", lambda i: i.get("pinned")),
        ("DESIRED/LOADED", _adapter_replicas),
        ("DESCRIPTION", lambda i: _short(i.get("description"), 40)),
    ],
    "deployments": [
        ("NAME", lambda i: i.get("name")),
        ("MODEL", lambda i: i.get("model")),
        ("PROFILE", lambda i: i.get("profile")),
        ("DESIRED", lambda i: i.get("replicas")),
        ("READY", lambda i: _status(i, "ready_replicas")),
        ("UPDATED", lambda i: _status(i, "updated_replicas")),
        ("STATE", lambda i: i.get("state")),
        ("REASON", lambda i: _short(_status(i, "reason"), 40)),
    ],
    "nodes": [
        ("NAME", lambda i: i.get("name")),
        ("APPROVAL", lambda i: i.get("approval_state")),
        ("POOL", lambda i: i.get("pool")),
        ("GPUS", _gpus),
        ("SHARDS", lambda i: i.get("num_shards")),
        ("CORDONED", lambda i: i.get("cordoned")),
        ("DRAINING", lambda i: i.get("draining")),
        ("LAST SYNC", lambda i: i.get("last_sync_at")),
    ],
    "replicas": [
        ("ID", lambda i: _short(i.get("id"), 8)),
        ("DEPLOYMENT", lambda i: i.get("deployment")),
        ("STATE", lambda i: i.get("state")),
        ("READY", lambda i: i.get("ready")),
        (
            "SHARDS",
            lambda i: " ".join(
                f"{s.get('node')}:{s.get('observed_state')}" for s in i.get("shards") or []
            ),
        ),
        ("STALE", lambda i: i.get("stale")),
        ("REASON", lambda i: _short(i.get("reason") or i.get("deployment_reason"), 40)),
    ],
    "bootstrap-tokens": [
        ("ID", lambda i: i.get("id")),
        ("POOL", lambda i: i.get("pool")),
        ("USES LEFT", _uses),
        ("APPROVAL", lambda i: "required" if i.get("require_approval") else "-"),
        ("EXPIRES", lambda i: i.get("expires_at")),
        ("REVOKED", lambda i: i.get("revoked")),
        ("DESCRIPTION", lambda i: _short(i.get("description"), 30)),
    ],
    "gpu-classes": [
        ("NAME", lambda i: i.get("name")),
        ("PATTERN", lambda i: i.get("pattern")),
        ("DESCRIPTION", lambda i: _short(i.get("description"), 40)),
    ],
    "actions": [
        ("AT", lambda i: i.get("at")),
        ("ACTION", lambda i: i.get("action")),
        ("DEPLOYMENT", lambda i: i.get("deployment") or "-"),
        ("REPLICA", lambda i: _short(i.get("replica_id"), 8)),
        ("NODE", lambda i: i.get("node") or "-"),
        ("REASON", lambda i: _short(i.get("reason"), 60)),
    ],
    "keys": [
        ("NAME", lambda i: i.get("name")),
        ("ID", lambda i: i.get("id")),
        ("MODELS", lambda i: ",".join(i.get("allowed_models") or []) or "*"),
        ("RPM", lambda i: i.get("rate_limit_rpm") or "-"),
        ("TPM", lambda i: i.get("rate_limit_tpm") or "-"),
        (
            "QUOTA",
            lambda i: (
                f"{i['token_quota']}/{i['quota_period']}"
                if i.get("token_quota") is not None
                else "-"
            ),
        ),
        ("CONCURRENCY", lambda i: i.get("concurrency_limit") or "-"),
        ("EXPIRES", lambda i: i.get("expires_at") or "-"),
        ("DISABLED", lambda i: i.get("disabled")),
    ],
}
_ALIASES = {kind.rstrip("s"): kind for kind in _TABLES} | {
    "key": "keys",
    "apikeys": "keys",
    "tokens": "bootstrap-tokens",
    "token": "bootstrap-tokens",
    "gpuclasses": "gpu-classes",
    "gpuclass": "gpu-classes",
}
# Kinds whose NAME argument filters a listing instead of naming one object.
_FILTERED_BY_NAME = {"actions": "deployment"}


def render_table(kind: str, items: Sequence[dict[str, Any]]) -> str:
    columns = _TABLES[kind]
    return tables.render_table(
        [h for h, _ in columns], [[read(i) for _, read in columns] for i in items]
    )


def _dump(data: Any, output: Output) -> str:
    if output is Output.json:
        return json.dumps(data, indent=2, sort_keys=True)
    import yaml

    return yaml.safe_dump(data, sort_keys=False).rstrip()


@exit_on_error
def get(
    kind: Annotated[
        str,
        typer.Argument(
            help="models, profiles, adapters, deployments, nodes, replicas, bootstrap-tokens "
            "(tokens), gpu-classes, actions or keys."
        ),
    ],
    name: Annotated[
        str | None,
        typer.Argument(
            help="One object (a replica's or token's id); all when omitted. For actions: "
            "the deployment whose actions to show."
        ),
    ] = None,
    output: Annotated[Output, typer.Option("--output", "-o", help="Output format.")] = Output.table,
    url: UrlOption = None,
    admin_token: TokenOption = None,
    data_dir: DataDirOption = None,
) -> None:
    """Show objects of one kind, like `kubectl get`."""
    plural = _ALIASES.get(kind.lower(), kind.lower())
    if plural not in _TABLES:
        fail(f"unknown kind {kind!r}; use one of {', '.join(_TABLES)}")
    data: Any
    with admin_client(url, admin_token, data_dir) as client:
        if name is not None and plural in _FILTERED_BY_NAME:
            items = client.list_all(plural, **{_FILTERED_BY_NAME[plural]: name})
            data = items
        elif name is not None:
            # Percent-encoded as `llmgw nodes` sends it (a deployment's "/" kept): a name from
            # before the name rule (a newline, a "?") is still one path segment.
            item = client.request("GET", f"/{plural}/{quote(name)}")
            items = [item]
            data = item
        else:
            items = client.list_all(plural)
            data = items
    typer.echo(render_table(plural, items) if output is Output.table else _dump(data, output))
