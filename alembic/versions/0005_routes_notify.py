"""Route changes announce themselves: a NOTIFY on `llmgw_routes_changed` from the database

Every write that can change what the gateway routes to (a shard's observed state, proxy URL,
desired state or release, a shard added or deleted, a replica's lifecycle state) sends one
notification per statement, from triggers, so no writer (the agent API's syncs, the
reconciler, an admin) can forget it. The gateways LISTEN and re-read their route table at
once instead of polling it twice a second; Postgres folds identical notifications of one
transaction into one.

Revision ID: 0005_routes_notify
Revises: 0004_api_key_limits
Create Date: 2026-11-30 21:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0005_routes_notify"
down_revision: str | None = "0004_api_key_limits"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Copies of tables.py's ROUTES_NOTIFY_DDL as of this revision: a migration must not change
# when the models do.
_STATEMENTS = (
    "CREATE FUNCTION llmgw_notify_routes() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN PERFORM pg_notify('llmgw_routes_changed', TG_TABLE_NAME); RETURN NULL; END $$",
    "CREATE TRIGGER shards_notify_routes AFTER INSERT OR DELETE OR UPDATE OF observed_state, "
    "proxy_url, desired_state, released, engine_api_key ON shards "
    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()",
    "CREATE TRIGGER replicas_notify_routes AFTER DELETE OR UPDATE OF state ON replicas "
    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()",
)


def upgrade() -> None:
    for statement in _STATEMENTS:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TRIGGER replicas_notify_routes ON replicas")
    op.execute("DROP TRIGGER shards_notify_routes ON shards")
    op.execute("DROP FUNCTION llmgw_notify_routes()")
