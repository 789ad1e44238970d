"""The cluster's response-id secret: what every gateway signs and checks Responses ids with

- cluster_info.response_id_secret: 32 random bytes, made by the server (two v4 UUIDs from
  gen_random_uuid(), Postgres's strong random source: 244 random bits), for the existing row
  as for a new one. Every gateway of the cluster reads it at start, so a response id one
  gateway wrapped (naming the replica that stores the response) any other unwraps, with no
  lookup per request (llmgw/gateway/apis/response_ids.py).

Revision ID: 0011_response_id_secret
Revises: 0010_profile_apis
Create Date: 2026-12-05 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0011_response_id_secret"
down_revision: str | None = "0010_profile_apis"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As tables.py spells it (_RANDOM_SECRET_SQL), at the time of this revision.
_RANDOM_SECRET_SQL = (
    "decode(replace(gen_random_uuid()::text, '-', '') || "
    "replace(gen_random_uuid()::text, '-', ''), 'hex')"
)


def upgrade() -> None:
    op.add_column(
        "cluster_info",
        sa.Column(
            "response_id_secret",
            sa.LargeBinary(),
            server_default=sa.text(_RANDOM_SECRET_SQL),
            nullable=False,
        ),
    )
    op.create_check_constraint(
        op.f("ck_cluster_info_response_id_secret_length"),
        "cluster_info",
        "length(response_id_secret) = 32",
    )


def downgrade() -> None:
    op.drop_constraint(
        op.f("ck_cluster_info_response_id_secret_length"), "cluster_info", type_="check"
    )
    op.drop_column("cluster_info", "response_id_secret")
