"""Flow control: a profile's admission ceiling, a key's queue priority, the gateways' demand

- profiles.max_in_flight: the gateways' per-replica admission ceiling (requests running plus
  waiting); 0, every existing profile's value, means the engine's default.
- api_keys.priority: the key's weight in the gateway queue's fairness (served priority + 1
  times the tokens of a priority-0 key); 0 for every existing key.
- gateway_demand: one row per (control plane instance, model), what its gateway holds:
  queued requests, in flight, shed count, saturated since; written every few seconds.

Revision ID: 0006_flow_control
Revises: 0005_routes_notify
Create Date: 2026-12-02 02:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0006_flow_control"
down_revision: str | None = "0005_routes_notify"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "profiles",
        sa.Column("max_in_flight", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column(
        "api_keys",
        sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.create_table(
        "gateway_demand",
        sa.Column("instance_id", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("queued", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("in_flight", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("shed", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("saturated_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "queued >= 0 AND in_flight >= 0 AND shed >= 0",
            name=op.f("ck_gateway_demand_counts_nonnegative"),
        ),
        sa.PrimaryKeyConstraint("instance_id", "model", name=op.f("pk_gateway_demand")),
    )


def downgrade() -> None:
    op.drop_table("gateway_demand")
    op.drop_column("api_keys", "priority")
    op.drop_column("profiles", "max_in_flight")
