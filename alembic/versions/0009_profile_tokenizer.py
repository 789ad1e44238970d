"""A profile's tokenizer: where the gateways' copy of the model's tokenizer comes from

- profiles.tokenizer: '' (every existing profile's value: the engine's own, its --tokenizer
  argument else model_path, as before), 'none' (no local tokenizer: agents ship nothing, the
  gateways ask a replica's /tokenize), or the absolute path of the directory on the nodes
  whose tokenizer files the agent ships. Not part of the fingerprint: adding the column rolls
  nothing.

Revision ID: 0009_profile_tokenizer
Revises: 0008_autoscale
Create Date: 2026-12-04 10:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0009_profile_tokenizer"
down_revision: str | None = "0008_autoscale"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "profiles",
        sa.Column("tokenizer", sa.Text(), server_default="", nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_profiles_tokenizer_valid"),
        "profiles",
        "tokenizer = '' OR tokenizer = 'none' OR left(tokenizer, 1) = '/'",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_profiles_tokenizer_valid"), "profiles", type_="check")
    op.drop_column("profiles", "tokenizer")
