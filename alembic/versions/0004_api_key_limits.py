"""API key limits and usage reads: tokens per minute, the quota's period, name and id formats

- api_keys.rate_limit_tpm (tokens per minute) and api_keys.quota_period (day | month, UTC);
  a quota and its period are set together or not at all. Keys stored before this revision
  that have a quota get the period "month".
- api_keys.name must match the key-name format (no slashes: names sit in URLs and commands),
  api_keys.id the id format (no underscore: the id sits between underscores in the key).
- usage_buckets gets an index on bucket_start, for usage reads by time over every key and
  the quota totals of a period.

Revision ID: 0004_api_key_limits
Revises: 0003_reconciler
Create Date: 2026-11-30 19:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0004_api_key_limits"
down_revision: str | None = "0003_reconciler"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Copies of tables.py's patterns as of this revision: a migration must not change when the
# models do.
_KEY_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
_KEY_ID_PATTERN = "^[0-9a-z]{1,32}$"


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("rate_limit_tpm", sa.Integer(), nullable=True))
    op.add_column("api_keys", sa.Column("quota_period", sa.Text(), nullable=True))
    op.execute("UPDATE api_keys SET quota_period = 'month' WHERE token_quota IS NOT NULL")
    # Refused by the new CHECKs, stated instead of left to a bare constraint error.
    op.execute(
        f"""
        DO $$
        DECLARE bad text;
        BEGIN
            SELECT name INTO bad FROM api_keys
            WHERE name !~ '{_KEY_NAME_PATTERN}' OR id !~ '{_KEY_ID_PATTERN}' LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION 'API key % has a name or id this release refuses (names: '
                    'letters, digits and ._:@-, at most 128; ids: lowercase letters and '
                    'digits); revoke it and create a new key, then upgrade again', bad;
            END IF;
        END $$
        """
    )
    op.create_check_constraint(
        op.f("ck_api_keys_rate_limit_tpm_positive"),
        "api_keys",
        "rate_limit_tpm IS NULL OR rate_limit_tpm > 0",
    )
    op.create_check_constraint(
        op.f("ck_api_keys_quota_period_known"),
        "api_keys",
        "(token_quota IS NULL) = (quota_period IS NULL) AND "
        "(quota_period IS NULL OR quota_period IN ('day', 'month'))",
    )
    op.create_check_constraint(
        op.f("ck_api_keys_name_format"), "api_keys", f"name ~ '{_KEY_NAME_PATTERN}'"
    )
    op.create_check_constraint(
        op.f("ck_api_keys_id_format"), "api_keys", f"id ~ '{_KEY_ID_PATTERN}'"
    )
    op.create_index(
        op.f("ix_usage_buckets_bucket_start"), "usage_buckets", ["bucket_start"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_usage_buckets_bucket_start"), table_name="usage_buckets")
    for name in ("id_format", "name_format", "quota_period_known", "rate_limit_tpm_positive"):
        op.drop_constraint(op.f(f"ck_api_keys_{name}"), "api_keys", type_="check")
    op.drop_column("api_keys", "quota_period")
    op.drop_column("api_keys", "rate_limit_tpm")
