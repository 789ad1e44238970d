"""The state store's schema: SQLAlchemy 2 typed tables for docs/architecture.md §3.

Desired state (models, profiles, adapters, deployments, api_keys) is written by operators
through the admin API; observed state (nodes, the binding half of shards) by
agents through the agent API. The rules that keep the fleet safe are enforced
here, in the database, and not only in Python: two control planes, an admin
script and a migration all go through the same constraints.

This module declares tables only. Queries live in ``queries.py``; every change
to what is declared here needs an Alembic migration (a test compares the two).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    event,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID, ExcludeConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column, relationship

# The API families a profile may list, which the profiles' CHECK holds too.
from llmgw.engines.spec import API_GROUPS

# The one name rule (llmgw.protocol.names), which the CHECK constraints below hold too.
from llmgw.protocol.names import KEY_NAME_PATTERN as KEY_NAME_PATTERN
from llmgw.protocol.names import NAME_PATTERN as NAME_PATTERN

__all__ = [
    "Adapter",
    "AdapterStatus",
    "ApiKey",
    "AuditLog",
    "Base",
    "BootstrapToken",
    "ClusterInfo",
    "ControlPlaneInstance",
    "Deployment",
    "DeploymentAutoscale",
    "DeploymentStatus",
    "GatewayDemand",
    "GpuAssignment",
    "GpuClass",
    "Leader",
    "Model",
    "Node",
    "NodeStatus",
    "Profile",
    "ReconcileAction",
    "Replica",
    "Shard",
    "UsageBucket",
    "UsageFlush",
]

# Deterministic constraint names, so migrations can drop and alter them by name.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SHARD_DESIRED_STATES = ("running", "suspended", "stopped")
SHARD_OBSERVED_STATES = (
    "pending",
    "starting",
    "ready",
    "unhealthy",
    "draining",
    "exited",
    "failed",
)
DEPLOYMENT_STATES = ("active", "suspended")
REPLICA_STATES = ("active", "draining", "stopping")
MULTINODE_BACKENDS = ("ray", "native")
NODE_APPROVAL_STATES = ("pending", "approved")
# No leading zeros, so "0" and "0%" are the only spellings of zero (the 0/0 CHECK relies on it).
ROLLOUT_BUDGET_PATTERN = "^(0|[1-9][0-9]{0,5})%?$"
KEY_ID_PATTERN = "^[0-9a-z]{1,32}$"
QUOTA_PERIODS = ("day", "month")


# PYTHONHASHSEED accepts only integers up to 2**32-1; canonical decimal, never 0.
_RANDOM_HASH_SEED_SQL = "(floor(random() * 4294967295) + 1)::bigint::text"
# 32 bytes from two v4 UUIDs: gen_random_uuid() is Postgres's strong random source (244 bits).
_RANDOM_SECRET_SQL = (
    "decode(replace(gen_random_uuid()::text, '-', '') || "
    "replace(gen_random_uuid()::text, '-', ''), 'hex')"
)
_VALID_HASH_SEED_SQL = (
    "CASE WHEN kv_hash_seed ~ '^[1-9][0-9]{0,9}$' "
    "THEN kv_hash_seed::bigint <= 4294967295 ELSE false END"
)

# A profile's tokenizer: empty, the keyword, or an absolute path (the API checks the rest).
_TOKENIZER_SQL = "tokenizer = '' OR tokenizer = 'none' OR left(tokenizer, 1) = '/'"

# A profile's API families (llmgw.engines.apis_problem): values from the known set, each once,
# a flat list. A NULL array or element fails every comparison, and a CHECK lets NULL through,
# so each clause must come out true or false, never NULL. Two known values, so "each once" is
# one comparison (a CHECK may hold no subquery to count distinct values with); a third family
# needs a migration anyway, and this clause rewritten with it.
_APIS_SQL = (
    "coalesce(array_ndims(apis), 1) = 1 "
    f"AND apis <@ ARRAY[{', '.join(repr(g) for g in API_GROUPS)}]::text[] "
    "AND array_position(apis, NULL) IS NULL "
    "AND (cardinality(apis) < 2 OR (cardinality(apis) = 2 AND apis[1] <> apis[2]))"
)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy reads this class attribute
        dict[str, Any]: JSONB,
        list[Any]: JSONB,
        uuid.UUID: UUID(as_uuid=True),
        datetime: DateTime(timezone=True),
    }


def _uuid_pk() -> Mapped[uuid.UUID]:
    return mapped_column(primary_key=True, server_default=text("gen_random_uuid()"))


def _created() -> Mapped[datetime]:
    return mapped_column(server_default=func.now())


class _Versioned:
    """Optimistic concurrency: every admin write bumps ``version``; a write that
    names a stale version matches no row and becomes a 409 instead of silently
    overwriting what the other admin just did."""

    version: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now())

    # The ORM bumps `version` on every UPDATE and adds `WHERE version = <read>`: even a writer
    # that skipped the row lock cannot overwrite a newer version (StaleDataError -> 409).
    @declared_attr.directive
    def __mapper_args__(cls) -> dict[str, Any]:
        return {"version_id_col": cls.__table__.c.version}  # type: ignore[attr-defined]


class ClusterInfo(Base):
    """The one row naming this cluster. Agents remember the id they registered
    with and stop acting on instructions from a database with another one (a
    restored backup, a foreign cluster), so a wrong URL cannot stop their engines."""

    __tablename__ = "cluster_info"
    __table_args__ = (
        CheckConstraint("id = 1", name="single_row"),
        CheckConstraint("length(response_id_secret) = 32", name="response_id_secret_length"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster_id: Mapped[uuid.UUID] = mapped_column(server_default=text("gen_random_uuid()"))
    # Default PYTHONHASHSEED of new profiles: random per cluster, an integer in 1..2**32-1
    # (what Python accepts; "0" would also turn off string-hash randomization in engines).
    kv_hash_seed: Mapped[str] = mapped_column(Text, server_default=text(_RANDOM_HASH_SEED_SQL))
    # What every gateway signs Responses ids with (gateway/apis/response_ids.py): random per
    # cluster, never sent anywhere, read by the gateways at start.
    response_id_secret: Mapped[bytes] = mapped_column(
        LargeBinary, server_default=text(_RANDOM_SECRET_SQL)
    )
    created_at: Mapped[datetime] = _created()


class Model(_Versioned, Base):
    __tablename__ = "models"
    __table_args__ = (CheckConstraint(f"name ~ '{NAME_PATTERN}'", name="name_format"),)

    id: Mapped[uuid.UUID] = _uuid_pk()
    name: Mapped[str] = mapped_column(Text, unique=True)
    description: Mapped[str] = mapped_column(Text, server_default="")

    profiles: Mapped[list[Profile]] = relationship(back_populates="model", passive_deletes=True)


class Profile(_Versioned, Base):
    """How a model runs on a GPU class. ``fingerprint`` is computed by
    ``llmgw.engines.profile_fingerprint`` over every launch-relevant field;
    shards remember the one they were started from, and a difference is what
    rolls replicas."""

    __tablename__ = "profiles"
    __table_args__ = (
        CheckConstraint(f"name ~ '{NAME_PATTERN}'", name="name_format"),
        CheckConstraint("tp >= 1", name="tp_positive"),
        CheckConstraint("pp >= 1", name="pp_positive"),
        CheckConstraint("nodes >= 1", name="nodes_positive"),
        CheckConstraint("gpus_per_node >= 0", name="gpus_per_node_nonnegative"),
        CheckConstraint("threads >= 0", name="threads_nonnegative"),
        CheckConstraint("kv_block_size >= 1", name="kv_block_size_positive"),
        CheckConstraint(_VALID_HASH_SEED_SQL, name="kv_hash_seed_valid"),
        CheckConstraint("kv_hash_algo = 'sha256_cbor'", name="kv_hash_algo_known"),
        CheckConstraint(
            _in("kv_extra_key_format", ("tagged", "legacy")), name="kv_extra_key_format_known"
        ),
        CheckConstraint("engine <> ''", name="engine_set"),
        CheckConstraint("model_path <> ''", name="model_path_set"),
        CheckConstraint(
            _in("multinode_backend", MULTINODE_BACKENDS), name="multinode_backend_known"
        ),
        CheckConstraint(_TOKENIZER_SQL, name="tokenizer_valid"),
        CheckConstraint(_APIS_SQL, name="apis_known"),
        CheckConstraint("adapter_slots >= 0 AND adapter_slots <= 1024", name="adapter_slots_range"),
        # What deployments' composite foreign key points at: a deployment's profile must be
        # one of its own model's profiles, whoever writes the row.
        UniqueConstraint("id", "model_id"),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    name: Mapped[str] = mapped_column(Text, unique=True)
    # A profile cannot outlive its model: the model's delete is refused while profiles exist.
    model_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("models.id", ondelete="RESTRICT"), index=True
    )
    description: Mapped[str] = mapped_column(Text, server_default="")
    engine: Mapped[str] = mapped_column(Text)
    gpu_class: Mapped[str] = mapped_column(Text, server_default="")
    tp: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    pp: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    gpus_per_node: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    nodes: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    model_path: Mapped[str] = mapped_column(Text)
    served_model_name: Mapped[str] = mapped_column(Text, server_default="")
    args: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))
    env: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    # name -> reference to a secret; write-only through the API, never in the fingerprint.
    secret_env: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    adapters: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))
    kv_events: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    threads: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    kv_hash_seed: Mapped[str] = mapped_column(Text)
    kv_block_size: Mapped[int] = mapped_column(Integer, server_default=text("16"))
    kv_hash_algo: Mapped[str] = mapped_column(Text, server_default="sha256_cbor")
    kv_extra_key_format: Mapped[str] = mapped_column(Text, server_default="tagged")
    # How a multi-node vLLM replica is wired (llmgw.engines.MultinodeBackend).
    multinode_backend: Mapped[str] = mapped_column(Text, server_default="ray")
    # The gateways' admission ceiling per replica; 0: the engine's default
    # (llmgw.engines.admission). Read live by the route table, never in the fingerprint.
    max_in_flight: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # Where the gateways' tokenizer comes from: "" the engine's own, "none", or a directory on
    # the nodes (llmgw.engines.tokenizer_problem). Read live by the route table, carried in
    # the launch specs of shards placed after an edit, never in the fingerprint.
    tokenizer: Mapped[str] = mapped_column(Text, server_default="")
    # The API families the model serves (llmgw.engines.API_GROUPS); empty: the engine's
    # default for the profile (Engine.served_apis). Read live by the route table, carried in
    # the launch specs of shards placed after an edit, never in the fingerprint.
    apis: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default="{}")
    # Runtime LoRA adapters each replica's engine holds at once (llmgw.engines.Profile):
    # 0, none. In the fingerprint through the flags it adds to the engine's command.
    adapter_slots: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    fingerprint: Mapped[str] = mapped_column(Text)

    model: Mapped[Model] = relationship(back_populates="profiles")


class Adapter(_Versioned, Base):
    """A LoRA adapter declared on its own (``kind: adapter``; issue [lora] "Adapters at
    runtime"): its name (what clients send as `model`, in the models' namespace), its base
    model, where nodes find it and how many replicas should hold it. The leader places it on
    replicas of profiles with ``adapter_slots`` (``Shard.desired_adapters``; its status in
    ``adapter_status``) and their agents load it at runtime. A profile's static ``adapters``
    are another thing and stay as they are.

    Keyed by name like ``gpu_classes``; ``model`` refers to the model by its name, which no
    route renames, so the row reads as the document it came from. RESTRICT: a model with
    adapters cannot be deleted (the admin API names them first)."""

    __tablename__ = "adapters"
    __table_args__ = (
        CheckConstraint(f"name ~ '{NAME_PATTERN}'", name="name_format"),
        CheckConstraint("path <> ''", name="path_set"),
        CheckConstraint(
            "min_replicas IS NULL OR min_replicas >= 0", name="min_replicas_nonnegative"
        ),
        CheckConstraint("max_replicas IS NULL OR max_replicas >= 1", name="max_replicas_positive"),
        # NULL on either side is "the default", which any bound of the other side allows.
        CheckConstraint(
            "min_replicas IS NULL OR max_replicas IS NULL OR max_replicas >= min_replicas",
            name="replicas_ordered",
        ),
    )

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    model: Mapped[str] = mapped_column(ForeignKey("models.name", ondelete="RESTRICT"), index=True)
    # A directory on the nodes, or an http(s) source the agent downloads (as a profile's
    # adapters take it: agent.policy.allowed_adapter_sources decides on each node).
    path: Mapped[str] = mapped_column(Text)
    # Replicas of the base model that should hold it loaded; NULL: the default
    # (planner.adapter_placement: by demand, one from its first request; every replica).
    min_replicas: Mapped[int | None] = mapped_column(Integer)
    max_replicas: Mapped[int | None] = mapped_column(Integer)
    # Kept loaded on its replicas, never evicted for another adapter.
    pinned: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    description: Mapped[str] = mapped_column(Text, server_default="")


class AdapterStatus(Base):
    """What the leader's placement decided for a declared adapter, written by the reconciler
    alone (kept off the adapter's row, as deployment_status is, so a status write never bumps
    the version an admin's update names). Which replicas hold it is the shards' to say
    (``Shard.desired_adapters``/``observed_adapters``); this is what they cannot: the count
    wanted and why it is not met."""

    __tablename__ = "adapter_status"
    __table_args__ = (
        CheckConstraint("desired_replicas >= 0", name="desired_replicas_nonnegative"),
    )

    adapter: Mapped[str] = mapped_column(
        ForeignKey("adapters.name", ondelete="CASCADE"), primary_key=True
    )
    # Replicas that should hold it: the placement's count after min/max_replicas.
    desired_replicas: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # Why it has fewer holders than desired, or none at all; "" when it has them.
    unplaced: Mapped[str] = mapped_column(Text, server_default="")
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now())


class Deployment(_Versioned, Base):
    __tablename__ = "deployments"
    __table_args__ = (
        CheckConstraint(f"name ~ '{NAME_PATTERN}'", name="name_format"),
        CheckConstraint("replicas >= 0", name="replicas_nonnegative"),
        CheckConstraint(
            f"max_surge ~ '{ROLLOUT_BUDGET_PATTERN}' AND max_unavailable ~ '{ROLLOUT_BUDGET_PATTERN}'",
            name="rollout_budget_format",
        ),
        # 0/0 can never make progress: no new replica may start and no old one may stop.
        CheckConstraint(
            "NOT (max_surge IN ('0', '0%') AND max_unavailable IN ('0', '0%'))",
            name="rollout_can_progress",
        ),
        CheckConstraint("progress_deadline_s > 0", name="progress_deadline_positive"),
        CheckConstraint(_in("state", DEPLOYMENT_STATES), name="state_known"),
        CheckConstraint("generation >= 1", name="generation_positive"),
        # SQL NULL is "no policy": a JSON null there would read as a policy to `IS NOT NULL`.
        CheckConstraint(
            "autoscale IS NULL OR jsonb_typeof(autoscale) = 'object'", name="autoscale_object"
        ),
        # A profile in use by a deployment cannot be deleted (RESTRICT), and it must belong to
        # the deployment's model: a replica launched from another model's profile would serve
        # the wrong weights under this model's name.
        ForeignKeyConstraint(
            ["profile_id", "model_id"],
            ["profiles.id", "profiles.model_id"],
            name="fk_deployments_profile_id_profiles",
            ondelete="RESTRICT",
        ),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    name: Mapped[str] = mapped_column(Text, unique=True)
    model_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("models.id", ondelete="RESTRICT"), index=True
    )
    profile_id: Mapped[uuid.UUID] = mapped_column(index=True)
    pool: Mapped[str] = mapped_column(Text, server_default="default")
    replicas: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    # A count ("1") or a share of the desired replicas ("25%"), resolved by the reconciler as
    # Kubernetes does: surge rounds up, unavailable rounds down, and if both come to zero
    # unavailable becomes 1. Kept as written so a later change of `replicas` rescales it.
    max_surge: Mapped[str] = mapped_column(Text, server_default="1")
    max_unavailable: Mapped[str] = mapped_column(Text, server_default="0")
    progress_deadline_s: Mapped[int] = mapped_column(Integer, server_default=text("600"))
    state: Mapped[str] = mapped_column(Text, server_default="active")
    # Bumped by every admin change of the deployment or its profile; the rollout status says
    # which generation it describes (observed_generation), as Kubernetes does.
    generation: Mapped[int] = mapped_column(BigInteger, server_default=text("1"))
    # The document's `autoscale:` mapping as validated (schemas.AutoscaleBody); None: the
    # replica count is `replicas`, fixed. With it, `replicas` is only where scaling starts.
    # none_as_null: Python None is stored as SQL NULL, never as the JSON value null.
    autoscale: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))


class DeploymentAutoscale(Base):
    """The leader's last autoscale decision for a deployment, written only in its fenced pass
    (so a leader killed mid-scale leaves a count its successor converges on): how many
    replicas serve (``desired_replicas``) and stay placed (``warm_replicas``: serving plus
    suspended), when a count last moved (the windows count from it), since when the
    deployment is idle (carried across leaders: the in-memory history is not)."""

    __tablename__ = "deployment_autoscale"
    __table_args__ = (
        CheckConstraint(
            "desired_replicas >= 0 AND warm_replicas >= desired_replicas", name="counts_ordered"
        ),
    )

    deployment_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True
    )
    desired_replicas: Mapped[int] = mapped_column(Integer)
    warm_replicas: Mapped[int] = mapped_column(Integer)
    last_scaled_at: Mapped[datetime | None] = mapped_column()
    idle_since: Mapped[datetime | None] = mapped_column()
    # Since when replicas above desired are suspended (NULL: none is); they stop from it.
    suspended_since: Mapped[datetime | None] = mapped_column()
    reason: Mapped[str] = mapped_column(Text, server_default="")
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now())


class DeploymentStatus(Base):
    """A deployment's rollout status, written by the reconciler alone: kept off the
    deployment's row so status writes never bump the version an admin's update names."""

    __tablename__ = "deployment_status"

    deployment_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True
    )
    observed_generation: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    replicas: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    ready_replicas: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    updated_replicas: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    available_replicas: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    unavailable_replicas: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # Active replicas kept placed with their engines suspended (an autoscaler's idle ones).
    suspended_replicas: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    stalled: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    reason: Mapped[str] = mapped_column(Text, server_default="")
    # When the current unfinished stretch began or last made progress; NULL when complete.
    progress_started_at: Mapped[datetime | None] = mapped_column()
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now())


class Node(Base):
    """A machine that runs an agent: the admins' half (approval, pool, labels, cordon) and
    the reconciler's ``desired_version``. What the agent reports lives in ``node_status``,
    so a heartbeat never contends with (or overwrites) an admin's cordon on the same row."""

    __tablename__ = "nodes"
    __table_args__ = (
        CheckConstraint(_in("approval_state", NODE_APPROVAL_STATES), name="approval_state_known"),
        CheckConstraint("desired_version >= 0", name="desired_version_nonnegative"),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    name: Mapped[str] = mapped_column(Text, unique=True)
    # SHA-256 of the node credential; the credential itself is shown to the agent once.
    credential_hash: Mapped[bytes | None] = mapped_column(LargeBinary)
    approval_state: Mapped[str] = mapped_column(Text, server_default="pending")
    labels: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    pool: Mapped[str] = mapped_column(Text, server_default="default")
    cordoned: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    draining: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # The sync ETag: bumped in the same transaction as any change to this node's desired
    # shards, so an agent whose version matches is told "unchanged" without a shard read.
    desired_version: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # The token the node registered with; kept for audit after the token is gone.
    bootstrap_token_id: Mapped[str | None] = mapped_column(
        ForeignKey("bootstrap_tokens.id", ondelete="SET NULL")
    )
    created_at: Mapped[datetime] = _created()


class NodeStatus(Base):
    """What a node's agent reports, written only through the agent API (heartbeats batched)."""

    __tablename__ = "node_status"
    __table_args__ = (
        CheckConstraint("agent_epoch >= 0 AND agent_seq >= 0", name="agent_order_nonnegative"),
    )

    node_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    mgmt_addr: Mapped[str] = mapped_column(Text, server_default="")
    # GPUs (index, UUID, name, memory, compute capability, MIG parent), fabrics and their
    # HCAs with RoCE GID index, CPU threads, engine versions: llmgw.protocol.NodeInventory.
    inventory: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    agent_version: Mapped[str] = mapped_column(Text, server_default="")
    # A new epoch on every agent start; with the sequence number it orders reports, so a
    # delayed request of an earlier agent run never overwrites a newer one.
    agent_epoch: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    agent_seq: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    last_sync_at: Mapped[datetime | None] = mapped_column()


class BootstrapToken(Base):
    """A token that lets a new node register: ``llmgwb_<id>_<secret>``, SHA-256 of the secret
    kept. Expiring, limited in uses and to one pool; optionally its nodes wait for approval."""

    __tablename__ = "bootstrap_tokens"
    __table_args__ = (
        CheckConstraint("length(secret_sha256) = 32", name="secret_sha256_length"),
        CheckConstraint("uses_left IS NULL OR uses_left >= 0", name="uses_left_nonnegative"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    secret_sha256: Mapped[bytes] = mapped_column(LargeBinary, unique=True)
    description: Mapped[str] = mapped_column(Text, server_default="")
    pool: Mapped[str] = mapped_column(Text, server_default="default")
    require_approval: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    expires_at: Mapped[datetime] = mapped_column()
    # None: any number of nodes until it expires.
    uses_left: Mapped[int | None] = mapped_column(Integer)
    revoked: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    created_at: Mapped[datetime] = _created()


class Replica(Base):
    __tablename__ = "replicas"
    __table_args__ = (CheckConstraint(_in("state", REPLICA_STATES), name="state_known"),)

    id: Mapped[uuid.UUID] = _uuid_pk()
    # SET NULL, not CASCADE: deleting a deployment must not delete rows describing engines
    # that are still running. The reconciler (the leader, fenced) drains and stops them and
    # removes the rows once agents report the engines gone.
    deployment_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("deployments.id", ondelete="SET NULL"), index=True
    )
    profile_fingerprint: Mapped[str] = mapped_column(Text)
    # active: serving or on its way; draining: out of routing until idle or drain_deadline;
    # stopping: shards desired stopped, the row kept until every engine is reported gone.
    state: Mapped[str] = mapped_column(Text, server_default="active")
    drain_deadline: Mapped[datetime | None] = mapped_column()
    # Why the replica is draining or stopping, in the words of the action that did it.
    reason: Mapped[str] = mapped_column(Text, server_default="")
    created_at: Mapped[datetime] = _created()

    shards: Mapped[list[Shard]] = relationship(back_populates="replica", passive_deletes=True)


class Shard(Base):
    """One replica's part on one node. Two halves, two writers: the desired half
    is the control plane's, the binding half (observed_*, ports, pid) the agent's."""

    __tablename__ = "shards"
    __table_args__ = (
        UniqueConstraint("replica_id", "rank"),
        # The target of gpu_assignments' foreign key, which copies node and `released` from
        # here (ON UPDATE CASCADE) so its constraints can see them.
        UniqueConstraint("id", "node_id", "released"),
        CheckConstraint("rank >= 0", name="rank_nonnegative"),
        CheckConstraint(_in("desired_state", SHARD_DESIRED_STATES), name="desired_state_known"),
        CheckConstraint(_in("observed_state", SHARD_OBSERVED_STATES), name="observed_state_known"),
        CheckConstraint("restarts >= 0", name="restarts_nonnegative"),
        CheckConstraint(
            "leader_port IS NULL OR (leader_port BETWEEN 1 AND 65535)", name="leader_port_range"
        ),
        # Two live shards on one node never share a leader port; a released shard frees it.
        Index(
            "uq_shards_node_leader_port_live",
            "node_id",
            "leader_port",
            unique=True,
            postgresql_where=text("leader_port IS NOT NULL AND NOT released"),
        ),
        # The agent's sync reads its node's live shards.
        Index("ix_shards_node_live", "node_id", postgresql_where=text("NOT released")),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    # Shards live and die with their replica row, which outlives its engines (see Replica).
    replica_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("replicas.id", ondelete="CASCADE"), index=True
    )
    # RESTRICT: a node that still holds shards cannot be deleted and lose track of engines.
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="RESTRICT"))
    rank: Mapped[int] = mapped_column(Integer)
    # --- desired (control plane) ---
    # The shard's GPUs are its gpu_assignments rows (ordered by position), and only those: the
    # arrays gpu_indices/gpu_uuids that once sat here said the same thing a second time, with
    # nothing to keep the two in step, so the database refused double-booking in one and the
    # engine was launched from the other. The launch spec's devices are built from the rows.
    hcas: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default="{}")
    fabric: Mapped[str] = mapped_column(Text, server_default="")
    leader_port: Mapped[int | None] = mapped_column(Integer)
    # The complete llmgw.engines ShardSpec as JSON, minus the API key.
    launch_spec: Mapped[dict[str, Any]] = mapped_column(server_default=text("'{}'::jsonb"))
    profile_fingerprint: Mapped[str] = mapped_column(Text)
    desired_state: Mapped[str] = mapped_column(Text, server_default="running")
    # The key the engine demands; never returned by the admin API, never logged.
    engine_api_key: Mapped[str] = mapped_column(Text, server_default="")
    # Set once the agent reports the engine gone after a stop: frees GPUs and ports.
    released: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # The runtime adapters the leader placed on this shard's engine (rank 0 of a profile with
    # adapter_slots): [{"name", "path", "pinned"}], protocol.RuntimeAdapter. Sent beside the
    # launch spec, never part of it: a change loads or unloads, never restarts.
    desired_adapters: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))
    # --- binding (agent) ---
    http_port: Mapped[int | None] = mapped_column(Integer)
    kv_events_port: Mapped[int | None] = mapped_column(Integer)
    kv_replay_port: Mapped[int | None] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer)
    boot_id: Mapped[str | None] = mapped_column(Text)
    process_start_time: Mapped[int | None] = mapped_column(BigInteger)
    engine_version: Mapped[str | None] = mapped_column(Text)
    observed_state: Mapped[str] = mapped_column(Text, server_default="pending")
    observed_reason: Mapped[str] = mapped_column(Text, server_default="")
    # The fingerprint the running process was started from (a rollout landing, seen).
    observed_fingerprint: Mapped[str] = mapped_column(Text, server_default="")
    # Where the gateway reaches the engine: the shard's front door (its authenticating proxy).
    proxy_url: Mapped[str] = mapped_column(Text, server_default="")
    # The end of the engine's log when it failed (bounded by the protocol).
    log_tail: Mapped[str] = mapped_column(Text, server_default="")
    # The engine's runtime adapters as its agent last reported them: [{"name", "state",
    # "reason", "failures"}], protocol.AdapterObserved. The route table sends an adapter's
    # requests only where it is "loaded".
    observed_adapters: Mapped[list[Any]] = mapped_column(server_default=text("'[]'::jsonb"))
    restarts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    observed_at: Mapped[datetime | None] = mapped_column()
    started_at: Mapped[datetime | None] = mapped_column()
    exited_at: Mapped[datetime | None] = mapped_column()
    exit_code: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = _created()

    replica: Mapped[Replica] = relationship(back_populates="shards")


class GpuAssignment(Base):
    """The GPUs a shard holds, in the order its engine sees them: the one record of who
    holds which GPU. Keyed by the physical GPU (node, index) plus an optional MIG slice,
    so the database itself refuses double-booking, whichever way a placement bug or two
    racing leaders try it:

    * a whole GPU and any MIG slice of it (either order): the exclusion constraint;
    * a whole GPU twice, or one slice twice: the two partial unique indexes.

    An exclusion constraint, not a trigger that looks for conflicting rows: a trigger's
    check reads a snapshot, so two transactions inserting at once (or any under REPEATABLE
    READ) each miss the other's row and both commit; constraint indexes see uncommitted rows
    and make the second writer wait for the first, then fail. Only live shards count: a
    released shard's rows stay (they say what it held) but no longer block its GPUs.
    """

    __tablename__ = "gpu_assignments"
    __table_args__ = (
        # node_id and shard_released are the shard's own node and `released`, copied and kept
        # in step by the foreign key (a row cannot name another node than its shard's).
        ForeignKeyConstraint(
            ["shard_id", "node_id", "shard_released"],
            ["shards.id", "shards.node_id", "shards.released"],
            name="fk_gpu_assignments_shard",
            ondelete="CASCADE",
            onupdate="CASCADE",
        ),
        CheckConstraint("position >= 0", name="position_nonnegative"),
        CheckConstraint("gpu_index >= 0", name="gpu_index_nonnegative"),
        CheckConstraint("mig_uuid IS NULL OR mig_uuid LIKE 'MIG-%'", name="mig_uuid_format"),
        # Same GPU, one row whole and the other a slice: refused. (Two slices compare equal
        # here and pass; two wholes too, which the first index below refuses.)
        ExcludeConstraint(
            ("node_id", "="),
            ("gpu_index", "="),
            (text("((mig_uuid IS NULL)::integer)"), "<>"),
            name="ex_gpu_assignments_whole_or_slices",
            using="gist",
            where=text("NOT shard_released"),
        ),
        Index(
            "uq_gpu_assignments_whole_gpu_live",
            "node_id",
            "gpu_index",
            unique=True,
            postgresql_where=text("mig_uuid IS NULL AND NOT shard_released"),
        ),
        Index(
            "uq_gpu_assignments_mig_slice_live",
            "node_id",
            "mig_uuid",
            unique=True,
            postgresql_where=text("mig_uuid IS NOT NULL AND NOT shard_released"),
        ),
    )

    shard_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    # Index into the shard's device list (CUDA_VISIBLE_DEVICES order; rank-local device i).
    position: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    node_id: Mapped[uuid.UUID] = mapped_column()
    # The physical GPU's NVML index; for a MIG slice, its parent GPU's.
    gpu_index: Mapped[int] = mapped_column(Integer)
    # NULL: the whole GPU; "MIG-<uuid>": one MIG instance of it.
    mig_uuid: Mapped[str | None] = mapped_column(Text)
    shard_released: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))


class ApiKey(_Versioned, Base):
    """Keys look like ``llmgw_<id>_<secret>``; only SHA-256 of the secret is kept
    (a fast hash is right: keys are high-entropy and checked on every request).

    Written by the admin API (``llmgw.controlplane.admin.keys``), read by every gateway's
    ``KeyCache``; revoking sets ``disabled`` and keeps the row, which accounting refers to.
    """

    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint("length(secret_sha256) = 32", name="secret_sha256_length"),
        CheckConstraint("rate_limit_rpm IS NULL OR rate_limit_rpm > 0", name="rate_limit_positive"),
        CheckConstraint("token_quota IS NULL OR token_quota >= 0", name="token_quota_nonnegative"),
        CheckConstraint(
            "concurrency_limit IS NULL OR concurrency_limit > 0", name="concurrency_limit_positive"
        ),
        CheckConstraint(
            "rate_limit_tpm IS NULL OR rate_limit_tpm > 0", name="rate_limit_tpm_positive"
        ),
        # A quota without a period would never reset; a period without a quota limits nothing.
        CheckConstraint(
            f"(token_quota IS NULL) = (quota_period IS NULL) AND "
            f"(quota_period IS NULL OR {_in('quota_period', QUOTA_PERIODS)})",
            name="quota_period_known",
        ),
        CheckConstraint(f"name ~ '{KEY_NAME_PATTERN}'", name="name_format"),
        # The id travels in the clear inside the key, between underscores: an id holding one
        # would make `llmgw_<id>_<secret>` split in two ways.
        CheckConstraint(f"id ~ '{KEY_ID_PATTERN}'", name="id_format"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    secret_sha256: Mapped[bytes] = mapped_column(LargeBinary, unique=True)
    # None: every model; otherwise the model (and adapter) names this key may use.
    allowed_models: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    rate_limit_rpm: Mapped[int | None] = mapped_column(Integer)
    # Tokens per minute, counted from each request's reservation and corrected on completion.
    rate_limit_tpm: Mapped[int | None] = mapped_column(Integer)
    # Prompt + completion tokens per quota_period (UTC day or month); None: no quota.
    token_quota: Mapped[int | None] = mapped_column(BigInteger)
    quota_period: Mapped[str | None] = mapped_column(Text)
    concurrency_limit: Mapped[int | None] = mapped_column(Integer)
    # Tenant isolation: requests with this key never share KV cache with other tenants.
    cache_salt: Mapped[str | None] = mapped_column(Text)
    disabled: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    expires_at: Mapped[datetime | None] = mapped_column()
    # Set by the gateways' usage flushes (never on the request path): right to within a minute.
    last_used_at: Mapped[datetime | None] = mapped_column()
    # The gateway queue's weight for this key: served (priority + 1) times the tokens of a
    # priority-0 key while both wait (gateway/routing/fair_queue.py).
    priority: Mapped[int] = mapped_column(Integer, server_default=text("0"))


class UsageBucket(Base):
    """Tokens and requests per key, model and minute, summed by the gateways' usage flushes."""

    __tablename__ = "usage_buckets"
    __table_args__ = (
        UniqueConstraint("api_key_id", "model", "bucket_start"),
        CheckConstraint(
            "requests >= 0 AND prompt_tokens >= 0 AND completion_tokens >= 0 AND cached_tokens >= 0",
            name="counts_nonnegative",
        ),
        # `GET /admin/v1/usage?since=` over every key, and the quota totals of a period.
        Index("ix_usage_buckets_bucket_start", "bucket_start"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    # Accounting outlives a revoked key: revoke by disabling; deleting is refused while usage exists.
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="RESTRICT"))
    model: Mapped[str] = mapped_column(Text)
    bucket_start: Mapped[datetime] = mapped_column()
    requests: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    completion_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    cached_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))


class UsageFlush(Base):
    """One row per applied gateway flush, so a flush retried after a lost reply
    is recognised and not counted twice. A process keeps only its latest row: it retries a
    flush until it knows the outcome, so older sequence numbers can never come back."""

    __tablename__ = "usage_flushes"

    process_id: Mapped[str] = mapped_column(Text, primary_key=True)
    flush_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    applied_at: Mapped[datetime] = _created()


class AuditLog(Base):
    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_object", "object_kind", "object_name"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = _created()
    actor: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(Text)
    object_kind: Mapped[str] = mapped_column(Text)
    object_name: Mapped[str] = mapped_column(Text)
    # Secrets are redacted before they get here.
    before: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    request_id: Mapped[str] = mapped_column(Text, server_default="")


class ControlPlaneInstance(Base):
    __tablename__ = "controlplane_instances"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    internal_url: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = _created()
    last_seen_at: Mapped[datetime] = _created()


class GatewayDemand(Base):
    """What each control plane's gateway holds of each model: written every few seconds in
    one statement by that gateway (``store.demand``), read by ``llmgw status`` (a model whose
    fresh rows have ``saturated_since`` set is saturated) and by a later autoscaler. Rows of
    an instance that stopped go stale and are ignored by ``updated_at``."""

    __tablename__ = "gateway_demand"
    __table_args__ = (
        CheckConstraint("queued >= 0 AND in_flight >= 0 AND shed >= 0", name="counts_nonnegative"),
        CheckConstraint(
            "queued_prefill_tokens >= 0 AND uncached_prefill_tokens >= 0 AND held >= 0 "
            "AND engine_waiting >= 0",
            name="autoscale_counts_nonnegative",
        ),
        CheckConstraint("requests_per_s >= 0", name="requests_per_s_nonnegative"),
    )

    instance_id: Mapped[str] = mapped_column(Text, primary_key=True)
    model: Mapped[str] = mapped_column(Text, primary_key=True)
    queued: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    in_flight: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # Requests this instance shed for the model since it started.
    shed: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # Since when requests wait for the model (None: none waits).
    saturated_since: Mapped[datetime | None] = mapped_column()
    # Prompt tokens of the requests queued here or sent and not past their prefill, and the
    # part of them no prefix cache holds (what the autoscaler's prefill target reads).
    queued_prefill_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    uncached_prefill_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    # Requests waiting here for a model with no ready replica (scale from zero).
    held: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # What the engines report waiting (the load scrape), as this gateway last saw it: every
    # gateway scrapes the same engines, so readers take the largest, never the sum.
    engine_waiting: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # Share of routed prompt tokens found in a replica's prefix cache; None: none routed.
    hit_rate: Mapped[float | None] = mapped_column(Float)
    # Requests per second this gateway received for the name lately (a moving average): what
    # the leader's adapter placement scales an adapter's holders by.
    requests_per_s: Mapped[float] = mapped_column(Float, server_default=text("0"))
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now())


class Leader(Base):
    """The reconcile loop's fencing token. The advisory lock decides who leads;
    ``epoch`` rises on every takeover, and a plan is applied only in a transaction
    that still sees its own epoch, so a leader that lost its lock cannot write."""

    __tablename__ = "leader"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    holder: Mapped[str] = mapped_column(Text, server_default="")
    epoch: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    acquired_at: Mapped[datetime | None] = mapped_column()


class GpuClass(Base):
    """A GPU class profiles name (``gpu_class``), matched against the GPU names agents report
    (NVML's, e.g. "NVIDIA H100 80GB HBM3") by a regular expression. Stored, not configured per
    process, so every control plane places by the same rules."""

    __tablename__ = "gpu_classes"
    __table_args__ = (CheckConstraint(f"name ~ '{NAME_PATTERN}'", name="name_format"),)

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    pattern: Mapped[str] = mapped_column(Text)
    description: Mapped[str] = mapped_column(Text, server_default="")
    created_at: Mapped[datetime] = _created()


class ReconcileAction(Base):
    """What the reconciler did and why, newest kept: the answer to "why did my replica
    restart?". Bounded: the leader trims it to the newest rows on each pass."""

    __tablename__ = "reconcile_actions"
    __table_args__ = (Index("ix_reconcile_actions_deployment", "deployment", "id"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = _created()
    # The leader epoch that applied it.
    epoch: Mapped[int] = mapped_column(BigInteger)
    action: Mapped[str] = mapped_column(Text)
    deployment: Mapped[str] = mapped_column(Text, server_default="")
    replica_id: Mapped[uuid.UUID | None] = mapped_column()
    node: Mapped[str] = mapped_column(Text, server_default="")
    reason: Mapped[str] = mapped_column(Text, server_default="")


class TokenizerFile(Base):
    """One tokenizer file's bytes, keyed by their SHA-256: stored once however many nodes and
    models ship it (``store.tokenizers``). Capped in size by the agent API before it is
    written (``llmgw.kv.hf_tokenizer.MAX_FILE_BYTES``)."""

    __tablename__ = "tokenizer_files"
    __table_args__ = (CheckConstraint("size = length(content)", name="size_matches"),)

    sha256: Mapped[str] = mapped_column(Text, primary_key=True)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _created()


class ModelTokenizer(Base):
    """The tokenizer files the gateways tokenize a served model's prompts with: file name ->
    SHA-256 (rows of ``tokenizer_files``) and the set's digest; ``source`` says who shipped
    it (node and shard). Every change NOTIFYs the gateways (``store.tokenizers``)."""

    __tablename__ = "model_tokenizers"

    model: Mapped[str] = mapped_column(Text, primary_key=True)
    digest: Mapped[str] = mapped_column(Text)
    files: Mapped[dict[str, Any]] = mapped_column()
    source: Mapped[str] = mapped_column(Text, server_default="")
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now())


# Every write that can change a route NOTIFYs the gateways, from the database, so that no
# writer (agent syncs, the reconciler, an admin) can forget to (migration 0005). One
# notification per statement; Postgres folds a transaction's identical ones into one.
ROUTES_NOTIFY_DDL = (
    "CREATE FUNCTION llmgw_notify_routes() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN PERFORM pg_notify('llmgw_routes_changed', TG_TABLE_NAME); RETURN NULL; END $$",
    "CREATE TRIGGER shards_notify_routes AFTER INSERT OR DELETE OR UPDATE OF observed_state, "
    "proxy_url, desired_state, released, engine_api_key, observed_adapters ON shards "
    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()",
    "CREATE TRIGGER replicas_notify_routes AFTER DELETE OR UPDATE OF state ON replicas "
    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()",
    # Declared adapters (migration 0012): names and bases the gateways will route by once
    # adapters are placed; the route table re-reads on it already.
    "CREATE TRIGGER adapters_notify_routes AFTER INSERT OR DELETE OR UPDATE OF name, model, "
    "path, min_replicas, max_replicas, pinned ON adapters "
    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()",
)
for _statement in ROUTES_NOTIFY_DDL:
    event.listen(Base.metadata, "after_create", DDL(_statement))  # type: ignore[no-untyped-call]
