"""The reconciler's state: bootstrap tokens, the node row split, replica lifecycle, rollout status

- bootstrap_tokens: what lets a new node register (hash, expiry, uses left, pool, approval).
- nodes keeps the admins' half (approval, pool, labels, cordon) plus the reconciler's
  desired_version (the sync ETag); what agents report moves to node_status, so a heartbeat
  never contends with an admin's write on the same row.
- replicas get a lifecycle (active / draining with a deadline / stopping) and a reason.
- deployments get a generation; their rollout status gets its own table, written by the
  reconciler alone (writing it on the deployment's row would bump the admins' version).
- a deployment's profile must belong to its model: a composite foreign key.
- profiles record multinode_backend; shards record what the agent saw of a rollout.
- gpu_classes (name -> pattern over NVML names) and reconcile_actions (bounded record).
- the delete trigger that marked a deleted deployment's shards stopped is dropped: stopping
  goes through the reconciler's plan (drain, then stop), under the leader's fencing epoch.

No released control plane reads the node columns that move, so they move in one step.

Revision ID: 0003_reconciler
Revises: 0002_gpu_physical
Create Date: 2026-11-30 18:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0003_reconciler"
down_revision: str | None = "0002_gpu_physical"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NOW = sa.text("now()")

# 0001's trigger, recreated on downgrade exactly as it was.
_MARK_FOR_STOP_FN = """
CREATE FUNCTION llmgw_mark_shards_for_stop() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE shards SET desired_state = 'stopped'
    WHERE replica_id IN (SELECT id FROM replicas WHERE deployment_id = OLD.id)
      AND desired_state <> 'stopped';
    RETURN OLD;
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "bootstrap_tokens",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("secret_sha256", sa.LargeBinary(), nullable=False),
        sa.Column("description", sa.Text(), server_default="", nullable=False),
        sa.Column("pool", sa.Text(), server_default="default", nullable=False),
        sa.Column(
            "require_approval", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("uses_left", sa.Integer(), nullable=True),
        sa.Column("revoked", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.CheckConstraint(
            "length(secret_sha256) = 32", name=op.f("ck_bootstrap_tokens_secret_sha256_length")
        ),
        sa.CheckConstraint(
            "uses_left IS NULL OR uses_left >= 0",
            name=op.f("ck_bootstrap_tokens_uses_left_nonnegative"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bootstrap_tokens")),
        sa.UniqueConstraint("secret_sha256", name=op.f("uq_bootstrap_tokens_secret_sha256")),
    )

    # --- nodes: the agent's half moves to node_status ---
    op.create_table(
        "node_status",
        sa.Column("node_id", sa.UUID(), nullable=False),
        sa.Column("mgmt_addr", sa.Text(), server_default="", nullable=False),
        sa.Column(
            "inventory",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("agent_version", sa.Text(), server_default="", nullable=False),
        sa.Column("agent_epoch", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("agent_seq", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_sync_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "agent_epoch >= 0 AND agent_seq >= 0",
            name=op.f("ck_node_status_agent_order_nonnegative"),
        ),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_node_status_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_node_status")),
    )
    op.execute(
        "INSERT INTO node_status (node_id, mgmt_addr, inventory, agent_epoch, agent_seq, "
        "last_sync_at) SELECT id, mgmt_addr, inventory, agent_epoch, agent_seq, last_sync_at "
        "FROM nodes"
    )
    op.drop_constraint(op.f("ck_nodes_agent_epoch_nonnegative"), "nodes", type_="check")
    for column in ("mgmt_addr", "inventory", "agent_epoch", "agent_seq", "last_sync_at"):
        op.drop_column("nodes", column)
    op.add_column(
        "nodes",
        sa.Column("desired_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column("nodes", sa.Column("bootstrap_token_id", sa.String(32), nullable=True))
    op.create_foreign_key(
        op.f("fk_nodes_bootstrap_token_id_bootstrap_tokens"),
        "nodes",
        "bootstrap_tokens",
        ["bootstrap_token_id"],
        ["id"],
        ondelete="SET NULL",
    )
    op.create_check_constraint(
        op.f("ck_nodes_desired_version_nonnegative"), "nodes", "desired_version >= 0"
    )

    # --- replicas: lifecycle ---
    op.add_column(
        "replicas", sa.Column("state", sa.Text(), server_default="active", nullable=False)
    )
    op.add_column(
        "replicas", sa.Column("drain_deadline", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("replicas", sa.Column("reason", sa.Text(), server_default="", nullable=False))
    op.create_check_constraint(
        op.f("ck_replicas_state_known"),
        "replicas",
        "state IN ('active', 'draining', 'stopping')",
    )
    # Replicas of deployments deleted under 0001/0002 had their shards marked stopped.
    op.execute(
        "UPDATE replicas SET state = 'stopping', reason = 'its deployment was deleted' "
        "WHERE deployment_id IS NULL"
    )

    # --- profiles and deployments ---
    op.add_column(
        "profiles",
        sa.Column("multinode_backend", sa.Text(), server_default="ray", nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_profiles_multinode_backend_known"),
        "profiles",
        "multinode_backend IN ('ray', 'native')",
    )
    op.create_unique_constraint(op.f("uq_profiles_id_model_id"), "profiles", ["id", "model_id"])
    op.drop_constraint(
        op.f("fk_deployments_profile_id_profiles"), "deployments", type_="foreignkey"
    )
    # Refused by the new key, stated instead of left to a bare constraint error.
    op.execute(
        """
        DO $$
        DECLARE r record;
        BEGIN
            SELECT d.name AS deployment, p.name AS profile INTO r
            FROM deployments d JOIN profiles p ON p.id = d.profile_id
            WHERE p.model_id <> d.model_id LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION 'deployment % uses profile % of another model; point it at a '
                    'profile of its own model, then upgrade again', r.deployment, r.profile;
            END IF;
        END $$
        """
    )
    op.create_foreign_key(
        op.f("fk_deployments_profile_id_profiles"),
        "deployments",
        "profiles",
        ["profile_id", "model_id"],
        ["id", "model_id"],
        ondelete="RESTRICT",
    )
    op.add_column(
        "deployments",
        sa.Column("generation", sa.BigInteger(), server_default=sa.text("1"), nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_deployments_generation_positive"), "deployments", "generation >= 1"
    )
    op.create_table(
        "deployment_status",
        sa.Column("deployment_id", sa.UUID(), nullable=False),
        sa.Column(
            "observed_generation", sa.BigInteger(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column("replicas", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("ready_replicas", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("updated_replicas", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("available_replicas", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "unavailable_replicas", sa.Integer(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column("stalled", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("reason", sa.Text(), server_default="", nullable=False),
        sa.Column("progress_started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_deployment_status_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment_id", name=op.f("pk_deployment_status")),
    )

    # --- shards: what the agent saw ---
    for column in ("observed_fingerprint", "proxy_url", "log_tail"):
        op.add_column("shards", sa.Column(column, sa.Text(), server_default="", nullable=False))

    op.create_table(
        "gpu_classes",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("pattern", sa.Text(), nullable=False),
        sa.Column("description", sa.Text(), server_default="", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.CheckConstraint(
            "name ~ '^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$'", name=op.f("ck_gpu_classes_name_format")
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_gpu_classes")),
    )
    op.create_table(
        "reconcile_actions",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=_NOW, nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("deployment", sa.Text(), server_default="", nullable=False),
        sa.Column("replica_id", sa.UUID(), nullable=True),
        sa.Column("node", sa.Text(), server_default="", nullable=False),
        sa.Column("reason", sa.Text(), server_default="", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reconcile_actions")),
    )
    op.create_index(
        "ix_reconcile_actions_deployment", "reconcile_actions", ["deployment", "id"], unique=False
    )

    op.execute("DROP TRIGGER IF EXISTS deployments_mark_shards_for_stop ON deployments")
    op.execute("DROP FUNCTION IF EXISTS llmgw_mark_shards_for_stop()")


def downgrade() -> None:
    op.execute(_MARK_FOR_STOP_FN)
    op.execute(
        "CREATE TRIGGER deployments_mark_shards_for_stop BEFORE DELETE ON deployments "
        "FOR EACH ROW EXECUTE FUNCTION llmgw_mark_shards_for_stop()"
    )
    op.drop_index("ix_reconcile_actions_deployment", table_name="reconcile_actions")
    op.drop_table("reconcile_actions")
    op.drop_table("gpu_classes")
    for column in ("log_tail", "proxy_url", "observed_fingerprint"):
        op.drop_column("shards", column)
    op.drop_table("deployment_status")
    op.drop_constraint(op.f("ck_deployments_generation_positive"), "deployments", type_="check")
    op.drop_column("deployments", "generation")
    op.drop_constraint(
        op.f("fk_deployments_profile_id_profiles"), "deployments", type_="foreignkey"
    )
    op.create_foreign_key(
        op.f("fk_deployments_profile_id_profiles"),
        "deployments",
        "profiles",
        ["profile_id"],
        ["id"],
        ondelete="RESTRICT",
    )
    op.drop_constraint(op.f("uq_profiles_id_model_id"), "profiles", type_="unique")
    op.drop_constraint(op.f("ck_profiles_multinode_backend_known"), "profiles", type_="check")
    op.drop_column("profiles", "multinode_backend")
    op.drop_constraint(op.f("ck_replicas_state_known"), "replicas", type_="check")
    for column in ("reason", "drain_deadline", "state"):
        op.drop_column("replicas", column)
    op.drop_constraint(op.f("ck_nodes_desired_version_nonnegative"), "nodes", type_="check")
    op.drop_constraint(
        op.f("fk_nodes_bootstrap_token_id_bootstrap_tokens"), "nodes", type_="foreignkey"
    )
    op.drop_column("nodes", "bootstrap_token_id")
    op.drop_column("nodes", "desired_version")
    op.add_column("nodes", sa.Column("mgmt_addr", sa.Text(), server_default="", nullable=False))
    op.add_column(
        "nodes",
        sa.Column(
            "inventory",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
    )
    op.add_column(
        "nodes",
        sa.Column("agent_epoch", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column(
        "nodes",
        sa.Column("agent_seq", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column("nodes", sa.Column("last_sync_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        op.f("ck_nodes_agent_epoch_nonnegative"), "nodes", "agent_epoch >= 0"
    )
    op.execute(
        "UPDATE nodes n SET mgmt_addr = s.mgmt_addr, inventory = s.inventory, "
        "agent_epoch = s.agent_epoch, agent_seq = s.agent_seq, last_sync_at = s.last_sync_at "
        "FROM node_status s WHERE s.node_id = n.id"
    )
    op.drop_table("node_status")
    op.drop_table("bootstrap_tokens")
