"""The ``[controlplane]`` section: the state store, the internal listener, the admin token,
and its two subsections, ``[controlplane.reconcile]`` and ``[controlplane.agent_api]``.

What it must not do: read the environment or a file (loading.py does).
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from llmgw.config.section import Section
from llmgw.protocol.kvstream import MAX_BODY_BYTES as KV_MAX_BODY_BYTES
from llmgw.protocol.tokenizers import TOKENIZER_MAX_BODY_BYTES

__all__ = ["AgentApiSettings", "ControlPlaneSettings", "ReconcileSettings"]

_DB_URL_RE = re.compile(r"^postgresql(\+psycopg)?://")


class ReconcileSettings(Section):
    """The reconcile loop (leader only) and the rules its plan follows (docs/architecture.md §4)."""

    enabled: bool = Field(
        default=True,
        description="Run the reconcile loop in this process (it only passes while it leads). "
        "Off: this control plane serves APIs only.",
    )
    tick_s: float = Field(
        default=2.0, gt=0, le=300, description="Seconds between passes when nothing wakes it."
    )
    sync_period_s: float = Field(
        default=2.0, gt=0, le=60, description="The agents' sync period (agent.sync_interval_s)."
    )
    node_grace_s: float = Field(
        default=30.0,
        gt=0,
        description="A node whose agent has not synced for this long has its replicas replaced; "
        "at least 5 sync periods, so a node that misses a few syncs under load keeps them.",
    )
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="How long a draining replica may keep serving."
    )
    crash_loop_restarts: int = Field(
        default=5, ge=1, description="Restarts after which a shard's replica is replaced."
    )
    leader_port_min: int = Field(default=29500, ge=1, le=65535)
    leader_port_max: int = Field(default=29999, ge=1, le=65535)


class AgentApiSettings(Section):
    """The agent API on the internal listener: body caps, heartbeat batching, caches.

    Defaults are what a fleet of 1,000 nodes syncing every ~2 s needs.
    """

    # A sync carries up to 256 bindings with 8 KiB log tails each (2 MiB) plus an inventory.
    sync_max_body_bytes: int = Field(default=4 << 20, ge=64 << 10)
    # Registration is authenticated by a token inside the body: keep what an anonymous
    # client can make the process read small.
    register_max_body_bytes: int = Field(default=256 << 10, ge=16 << 10)
    kv_max_body_bytes: int = Field(default=KV_MAX_BODY_BYTES, ge=64 << 10)
    # A model's tokenizer files in base64 (tokenizer.json runs to ~35 MB for large vocabularies).
    tokenizer_max_body_bytes: int = Field(default=TOKENIZER_MAX_BODY_BYTES, ge=64 << 10)
    # Unchanged syncs only stamp last_sync_at: one UPDATE for all of them per period.
    heartbeat_flush_s: float = Field(default=1.0, gt=0, le=30)
    # controlplane_instances: beat period; an instance is live while seen within 3 periods.
    instance_heartbeat_s: float = Field(default=3.0, gt=0, le=60)
    # How often every node's row (credential, approval, drain, desired_version) is re-read in
    # one statement: unchanged syncs are answered from memory, so a reconciler's change
    # reaches an agent up to this much later. 0: read the node's row on every sync instead.
    node_refresh_s: float = Field(default=0.5, ge=0, le=30)
    # How often the placed-shard map the KV path reads is re-read (a sync that reads a node's
    # desired set updates that node's entries at once).
    placed_refresh_s: float = Field(default=5.0, gt=0, le=300)
    # Full KV copies admitted per second, and at once (429 + Retry-After beyond).
    kv_full_copy_rate_per_s: float = Field(default=200.0, gt=0)
    kv_full_copy_burst: int = Field(default=400, ge=1)
    # Syncs naming a node id not held in memory, read from the database per second, and at
    # once (429 + Retry-After beyond): a credential cannot be checked without its row, so a
    # flood of random ids would otherwise cost a transaction each.
    unknown_node_rate_per_s: float = Field(default=100.0, gt=0)
    unknown_node_burst: int = Field(default=200, ge=1)


class ControlPlaneSettings(Section):
    database_url: str = Field(
        default="",
        description="SQLAlchemy URL of the state store, postgresql+psycopg://user:pw@host:port/db. "
        "Empty under `llmgw up`, which starts its own Postgres.",
    )
    internal_host: str = Field(
        default="127.0.0.1",
        description="Address of the internal listener (admin API, agent API, metrics). "
        "Keep it off the public network.",
    )
    internal_port: int = Field(default=8081, ge=0, le=65535)
    max_connections: int = Field(
        default=10_000,
        ge=16,
        le=1_000_000,
        description="Open connections of the internal listener at most (default 10,000: a "
        "thousand agents hold two or three each), lowered at start to what the descriptor "
        "limit allows. At the cap a new connection evicts the oldest one idle or still "
        "sending its headers, so a health check gets in; when every connection is inside a "
        "request, it is closed as soon as accepted.",
    )
    max_header_bytes: int = Field(
        default=64 << 10,
        ge=4 << 10,
        le=16 << 20,
        description="Largest request line plus headers the internal listener reads (default "
        "64 KiB); a larger head is answered 431 and its connection closed.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Time a request's line and headers may take to arrive on the internal "
        "listener, from the connection's open or from their first byte (default 10 s); a "
        "slower client is answered 408 and closed.",
    )
    admin_token: str = Field(
        default="",
        description="Bearer token for the admin API; at least 16 characters. "
        "Generate one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`.",
    )
    db_pool_size: int = Field(default=10, ge=1, le=200)
    db_connect_timeout_s: float = Field(default=5.0, gt=0)
    admin_max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest admin API request body read; a larger one is refused with 413 "
        "before it is buffered. Profiles are small: raise it only for huge args/env lists.",
    )
    shutdown_grace_s: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="On SIGTERM/SIGINT, how long open requests of both listeners may finish "
        "before they are cut.",
    )
    advertise_url: str = Field(
        default="",
        description="Where agents reach this process's internal listener (its agent API), "
        "e.g. https://cp-1.mgmt:8081. Empty: http://<internal_host>:<internal_port>, with "
        "this host's name for a wildcard address.",
    )
    reconcile: ReconcileSettings = ReconcileSettings()
    agent_api: AgentApiSettings = AgentApiSettings()

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if v and not _DB_URL_RE.match(v):
            raise ValueError(
                "must start with postgresql+psycopg:// (or postgresql://); "
                "llmgw stores its state in Postgres only"
            )
        if v.startswith("postgresql://"):
            # psycopg 3 is the one driver we ship; SQLAlchemy would otherwise look for psycopg2.
            v = "postgresql+psycopg://" + v.removeprefix("postgresql://")
        return v

    @field_validator("admin_token")
    @classmethod
    def _check_token(cls, v: str) -> str:
        if v and len(v) < 16:
            raise ValueError("must be at least 16 characters (a short token can be guessed)")
        return v
