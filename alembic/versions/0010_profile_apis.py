"""A profile's API families: which of the gateways' routes its model answers

- profiles.apis: the API families (llmgw.engines.API_GROUPS: generate, pooling) the profile's
  model serves, each at most once; empty (every existing profile's value) is the engine's
  default for the profile (llmgw.engines.Engine.served_apis: vLLM's from its --runner, so a
  vLLM profile without `--runner pooling` serves generation as before; the simulator both).
  Read live by the gateways' route table. Not part of the fingerprint: adding the column
  rolls nothing.

Revision ID: 0010_profile_apis
Revises: 0009_profile_tokenizer
Create Date: 2026-12-10 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0010_profile_apis"
down_revision: str | None = "0009_profile_tokenizer"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The rule as it stood when this revision was written (tables.py spells today's): values from
# the known set, each once, a flat list. A NULL array or element fails every comparison, and
# a CHECK lets NULL through, so each clause must come out true or false, never NULL.
_APIS_SQL = (
    "coalesce(array_ndims(apis), 1) = 1 "
    "AND apis <@ ARRAY['generate', 'pooling']::text[] "
    "AND array_position(apis, NULL) IS NULL "
    "AND (cardinality(apis) < 2 OR (cardinality(apis) = 2 AND apis[1] <> apis[2]))"
)


def upgrade() -> None:
    op.add_column(
        "profiles",
        sa.Column(
            "apis",
            postgresql.ARRAY(sa.Text()),
            server_default="{}",
            nullable=False,
        ),
    )
    op.create_check_constraint(op.f("ck_profiles_apis_known"), "profiles", _APIS_SQL)


def downgrade() -> None:
    op.drop_constraint(op.f("ck_profiles_apis_known"), "profiles", type_="check")
    op.drop_column("profiles", "apis")
