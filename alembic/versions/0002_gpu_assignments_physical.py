"""GPU assignments keyed by the physical GPU; the shard's device arrays folded into them

0001 keyed gpu_assignments by a string, "3" for GPU 3 and "MIG-<uuid>" for a MIG slice, so
a whole GPU and a slice of it were two unrelated keys and both could be assigned; the shards'
gpu_indices/gpu_uuids arrays said a second time which devices a shard holds, with nothing
tying the two. Now a row names (node, GPU index, optional MIG slice) in the shard's device
order, an exclusion constraint and two partial unique indexes refuse every double booking,
and the arrays are gone (their contents become rows).

Revision ID: 0002_gpu_physical
Revises: 0001_initial
Create Date: 2026-11-30 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0002_gpu_physical"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rows for every device a shard's arrays name, in array order; then 0001 assignments the arrays
# did not mention (a whole GPU by index is appended after them). A 0001 MIG key whose parent GPU
# the arrays do not give cannot be placed on a physical GPU: the upgrade stops and names it,
# rather than guess and let the new constraints miss a double booking.
_COPY_FORWARD = """
INSERT INTO gpu_assignments (shard_id, position, node_id, gpu_index, mig_uuid, shard_released)
SELECT s.id, (d.ord - 1)::smallint, s.node_id, d.idx,
       CASE WHEN d.uuid LIKE 'MIG-%' THEN d.uuid END, s.released
FROM shards s, unnest(s.gpu_indices, s.gpu_uuids) WITH ORDINALITY AS d(idx, uuid, ord)
WHERE d.idx IS NOT NULL;

DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT o.* FROM gpu_assignments_0001 o
        WHERE NOT EXISTS (
            SELECT 1 FROM gpu_assignments n
            WHERE n.shard_id = o.shard_id
              AND (n.mig_uuid = o.gpu_key
                   OR (n.mig_uuid IS NULL AND n.gpu_index::text = o.gpu_key)))
    LOOP
        IF r.gpu_key !~ '^[0-9]+$' THEN
            RAISE EXCEPTION 'gpu_assignments row (node %, %, shard %): the parent GPU of this '
                'MIG instance is not in the shard''s gpu_indices/gpu_uuids, so it cannot be '
                'keyed by physical GPU; add it to the shard''s arrays or delete the row, '
                'then upgrade again', r.node_id, r.gpu_key, r.shard_id;
        END IF;
        INSERT INTO gpu_assignments
            (shard_id, position, node_id, gpu_index, mig_uuid, shard_released)
        SELECT s.id,
               (SELECT coalesce(max(position) + 1, 0) FROM gpu_assignments
                WHERE shard_id = s.id),
               s.node_id, r.gpu_key::integer, NULL, s.released
        FROM shards s WHERE s.id = r.shard_id;
    END LOOP;
END
$$;
"""

_COPY_BACK = """
UPDATE shards s SET
    gpu_indices = a.indices,
    gpu_uuids = CASE WHEN a.any_mig THEN a.uuids ELSE '{}' END
FROM (
    SELECT shard_id,
           array_agg(gpu_index ORDER BY position) AS indices,
           array_agg(coalesce(mig_uuid, '') ORDER BY position) AS uuids,
           bool_or(mig_uuid IS NOT NULL) AS any_mig
    FROM gpu_assignments GROUP BY shard_id
) a
WHERE a.shard_id = s.id;

INSERT INTO gpu_assignments_0002 (node_id, gpu_key, shard_id)
SELECT node_id, coalesce(mig_uuid, gpu_index::text), shard_id
FROM gpu_assignments WHERE NOT shard_released;
"""


def upgrade() -> None:
    # Trusted since PostgreSQL 13: the database's owner may create it; `llmgw up` creates it
    # as the superuser beforehand. Never dropped by downgrade: others may use it.
    op.execute("CREATE EXTENSION IF NOT EXISTS btree_gist")
    op.create_unique_constraint(
        op.f("uq_shards_id_node_id_released"), "shards", ["id", "node_id", "released"]
    )
    op.execute("ALTER TABLE gpu_assignments RENAME TO gpu_assignments_0001")
    op.execute("ALTER INDEX ix_gpu_assignments_shard_id RENAME TO ix_gpu_assignments_0001_shard")
    op.execute(
        "ALTER TABLE gpu_assignments_0001 RENAME CONSTRAINT pk_gpu_assignments "
        "TO pk_gpu_assignments_0001"
    )
    op.create_table(
        "gpu_assignments",
        sa.Column("shard_id", sa.Uuid(), nullable=False),
        sa.Column("position", sa.SmallInteger(), nullable=False),
        sa.Column("node_id", sa.Uuid(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("mig_uuid", sa.Text(), nullable=True),
        sa.Column("shard_released", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.CheckConstraint("gpu_index >= 0", name=op.f("ck_gpu_assignments_gpu_index_nonnegative")),
        sa.CheckConstraint(
            "mig_uuid IS NULL OR mig_uuid LIKE 'MIG-%'",
            name=op.f("ck_gpu_assignments_mig_uuid_format"),
        ),
        sa.CheckConstraint("position >= 0", name=op.f("ck_gpu_assignments_position_nonnegative")),
        sa.ForeignKeyConstraint(
            ["shard_id", "node_id", "shard_released"],
            ["shards.id", "shards.node_id", "shards.released"],
            name="fk_gpu_assignments_shard",
            onupdate="CASCADE",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("shard_id", "position", name=op.f("pk_gpu_assignments")),
        postgresql.ExcludeConstraint(
            ("node_id", "="),
            ("gpu_index", "="),
            (sa.text("((mig_uuid IS NULL)::integer)"), "<>"),
            name="ex_gpu_assignments_whole_or_slices",
            using="gist",
            where=sa.text("NOT shard_released"),
        ),
    )
    op.create_index(
        "uq_gpu_assignments_whole_gpu_live",
        "gpu_assignments",
        ["node_id", "gpu_index"],
        unique=True,
        postgresql_where=sa.text("mig_uuid IS NULL AND NOT shard_released"),
    )
    op.create_index(
        "uq_gpu_assignments_mig_slice_live",
        "gpu_assignments",
        ["node_id", "mig_uuid"],
        unique=True,
        postgresql_where=sa.text("mig_uuid IS NOT NULL AND NOT shard_released"),
    )
    # Existing data that double-books a GPU makes this fail, naming the constraint: it has to
    # be resolved by hand (which shard really holds the GPU), not by the migration.
    op.execute(_COPY_FORWARD)
    op.drop_table("gpu_assignments_0001")
    op.drop_column("shards", "gpu_uuids")
    op.drop_column("shards", "gpu_indices")


def downgrade() -> None:
    op.add_column(
        "shards",
        sa.Column(
            "gpu_indices", postgresql.ARRAY(sa.Integer()), server_default="{}", nullable=False
        ),
    )
    op.add_column(
        "shards",
        sa.Column("gpu_uuids", postgresql.ARRAY(sa.Text()), server_default="{}", nullable=False),
    )
    # 0001's table as 0001 made it, filled from the live rows (a released shard held nothing).
    op.create_table(
        "gpu_assignments_0002",
        sa.Column("node_id", sa.Uuid(), nullable=False),
        sa.Column("gpu_key", sa.Text(), nullable=False),
        sa.Column("shard_id", sa.Uuid(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_gpu_assignments_node_id_nodes"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["shard_id"],
            ["shards.id"],
            name=op.f("fk_gpu_assignments_shard_id_shards"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("node_id", "gpu_key", name=op.f("pk_gpu_assignments_0002")),
    )
    op.execute(_COPY_BACK)
    op.drop_table("gpu_assignments")
    op.execute("ALTER TABLE gpu_assignments_0002 RENAME TO gpu_assignments")
    op.execute(
        "ALTER TABLE gpu_assignments RENAME CONSTRAINT pk_gpu_assignments_0002 "
        "TO pk_gpu_assignments"
    )
    op.create_index(
        op.f("ix_gpu_assignments_shard_id"), "gpu_assignments", ["shard_id"], unique=False
    )
    op.drop_constraint(op.f("uq_shards_id_node_id_released"), "shards", type_="unique")
