"""Adapters declared on their own: `kind: adapter` documents (issue [lora] "Adapters at runtime")

- adapters: one row per LoRA adapter declared by an operator, keyed by its name (what clients
  send as `model`, in the models' namespace): its base model (by name; RESTRICT, so a model
  with adapters cannot be deleted), where nodes find it (`path`: a directory or an http(s)
  source, never empty), the replicas that should hold it (`min_replicas` >= 0,
  `max_replicas` >= 1, max >= min where both are set; NULL: the default), `pinned`, a
  description, and the admin tables' version and timestamps. The declaration only: nothing
  places or loads an adapter from it yet.
- adapters_notify_routes: a write to it NOTIFYs `llmgw_routes_changed` through migration
  0005's function, as shards and replicas do, so the gateways' route caches hear of it.

Profiles and their static `adapters` are not touched: every existing profile keeps its
adapters, its fingerprint and its replicas.

Revision ID: 0012_adapters
Revises: 0011_response_id_secret
Create Date: 2026-12-06 03:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0012_adapters"
down_revision: str | None = "0011_response_id_secret"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As tables.py spells them at the time of this revision: a migration must not change when the
# models do.
_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
_TRIGGER = (
    "CREATE TRIGGER adapters_notify_routes AFTER INSERT OR DELETE OR UPDATE OF name, model, "
    "path, min_replicas, max_replicas, pinned ON adapters "
    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()"
)


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("min_replicas", sa.Integer(), nullable=True),
        sa.Column("max_replicas", sa.Integer(), nullable=True),
        sa.Column("pinned", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("description", sa.Text(), server_default="", nullable=False),
        sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(f"name ~ '{_NAME_PATTERN}'", name=op.f("ck_adapters_name_format")),
        sa.CheckConstraint("path <> ''", name=op.f("ck_adapters_path_set")),
        sa.CheckConstraint(
            "min_replicas IS NULL OR min_replicas >= 0",
            name=op.f("ck_adapters_min_replicas_nonnegative"),
        ),
        sa.CheckConstraint(
            "max_replicas IS NULL OR max_replicas >= 1",
            name=op.f("ck_adapters_max_replicas_positive"),
        ),
        sa.CheckConstraint(
            "min_replicas IS NULL OR max_replicas IS NULL OR max_replicas >= min_replicas",
            name=op.f("ck_adapters_replicas_ordered"),
        ),
        sa.ForeignKeyConstraint(
            ["model"],
            ["models.name"],
            name=op.f("fk_adapters_model_models"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_adapters")),
    )
    op.create_index(op.f("ix_adapters_model"), "adapters", ["model"], unique=False)
    op.execute(_TRIGGER)


def downgrade() -> None:
    op.execute("DROP TRIGGER adapters_notify_routes ON adapters")
    op.drop_index(op.f("ix_adapters_model"), table_name="adapters")
    op.drop_table("adapters")
