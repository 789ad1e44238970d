"""Autoscaling: a deployment's policy, the leader's last decision, richer gateway demand

- deployments.autoscale: the deployment document's ``autoscale:`` mapping (NULL: the
  replica count stays the operator's ``replicas``).
- deployment_autoscale: one row per autoscaled deployment, written by the leader alone in
  its fenced pass: the serving and placed (serving + suspended) counts it decided, when it
  last moved them, since when the deployment is idle, the last reason.
- deployment_status.suspended_replicas: replicas kept placed with their engines suspended.
- gateway_demand: per (instance, model) also queued and uncached prefill tokens, requests
  held for a model with no ready replica, engine-reported waiting requests, the prefix hit
  rate of what was routed.

Revision ID: 0008_autoscale
Revises: 0007_tokenizer_files
Create Date: 2026-12-03 14:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0008_autoscale"
down_revision: str | None = "0007_tokenizer_files"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_DEMAND_COLUMNS = (
    ("queued_prefill_tokens", sa.BigInteger()),
    ("uncached_prefill_tokens", sa.BigInteger()),
    ("held", sa.Integer()),
    ("engine_waiting", sa.Integer()),
)


def upgrade() -> None:
    op.add_column(
        "deployments",
        sa.Column("autoscale", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )
    op.create_check_constraint(
        op.f("ck_deployments_autoscale_object"),
        "deployments",
        "autoscale IS NULL OR jsonb_typeof(autoscale) = 'object'",
    )
    op.create_table(
        "deployment_autoscale",
        sa.Column("deployment_id", sa.Uuid(), nullable=False),
        sa.Column("desired_replicas", sa.Integer(), nullable=False),
        sa.Column("warm_replicas", sa.Integer(), nullable=False),
        sa.Column("last_scaled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("idle_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("suspended_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.Text(), server_default="", nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "desired_replicas >= 0 AND warm_replicas >= desired_replicas",
            name=op.f("ck_deployment_autoscale_counts_ordered"),
        ),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_deployment_autoscale_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment_id", name=op.f("pk_deployment_autoscale")),
    )
    op.add_column(
        "deployment_status",
        sa.Column("suspended_replicas", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    for name, type_ in _DEMAND_COLUMNS:
        op.add_column(
            "gateway_demand",
            sa.Column(name, type_, server_default=sa.text("0"), nullable=False),
        )
    op.add_column("gateway_demand", sa.Column("hit_rate", sa.Float(), nullable=True))
    op.create_check_constraint(
        op.f("ck_gateway_demand_autoscale_counts_nonnegative"),
        "gateway_demand",
        "queued_prefill_tokens >= 0 AND uncached_prefill_tokens >= 0 AND held >= 0 "
        "AND engine_waiting >= 0",
    )


def downgrade() -> None:
    op.drop_constraint(
        op.f("ck_gateway_demand_autoscale_counts_nonnegative"), "gateway_demand", type_="check"
    )
    op.drop_column("gateway_demand", "hit_rate")
    for name, _ in reversed(_DEMAND_COLUMNS):
        op.drop_column("gateway_demand", name)
    op.drop_column("deployment_status", "suspended_replicas")
    op.drop_table("deployment_autoscale")
    op.drop_column("deployments", "autoscale")
