"""Adapter status: what the leader's placement decided for each declared adapter

- adapter_status: one row per declared adapter the leader has placed (or failed to), written
  by the reconciler alone, beside the operator's row as deployment_status is beside a
  deployment's (a status write never bumps the version an admin's update names): how many
  replicas should hold it (`desired_replicas`, the placement's count after its bounds) and
  why it has fewer or none (`unplaced`, "" when it has them). Which replicas hold it is not
  repeated here: shards.desired_adapters and observed_adapters say that. Deleted with its
  adapter (CASCADE).

Nothing else changes: the placement fills the rows on its next pass.

Revision ID: 0014_adapter_status
Revises: 0013_runtime_adapters
Create Date: 2026-12-06 04:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0014_adapter_status"
down_revision: str | None = "0013_runtime_adapters"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapter_status",
        sa.Column("adapter", sa.Text(), nullable=False),
        sa.Column("desired_replicas", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("unplaced", sa.Text(), server_default="", nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "desired_replicas >= 0", name=op.f("ck_adapter_status_desired_replicas_nonnegative")
        ),
        sa.ForeignKeyConstraint(
            ["adapter"],
            ["adapters.name"],
            name=op.f("fk_adapter_status_adapter_adapters"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("adapter", name=op.f("pk_adapter_status")),
    )


def downgrade() -> None:
    op.drop_table("adapter_status")
