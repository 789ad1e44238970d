"""Tokenizer files: each model's tokenizer, shipped by the agents, content-addressed

- tokenizer_files: one row per distinct file (its SHA-256 the key), stored once however
  many nodes and models ship it.
- model_tokenizers: per served model name, the set the gateways tokenize its prompts with
  (file name -> SHA-256, and the set's digest), the shard and node that shipped it.

Revision ID: 0007_tokenizer_files
Revises: 0006_flow_control
Create Date: 2026-12-03 14:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0007_tokenizer_files"
down_revision: str | None = "0006_flow_control"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tokenizer_files",
        sa.Column("sha256", sa.Text(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("size = length(content)", name=op.f("ck_tokenizer_files_size_matches")),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_tokenizer_files")),
    )
    op.create_table(
        "model_tokenizers",
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("digest", sa.Text(), nullable=False),
        sa.Column("files", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("source", sa.Text(), server_default="", nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("model", name=op.f("pk_model_tokenizers")),
    )


def downgrade() -> None:
    op.drop_table("model_tokenizers")
    op.drop_table("tokenizer_files")
