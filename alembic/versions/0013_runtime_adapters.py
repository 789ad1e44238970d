"""Runtime adapters: what the leader places on each replica, what its agent reports loaded

- profiles.adapter_slots: the runtime LoRA adapters each replica's engine holds at once
  (llmgw.engines.Profile.adapter_slots); 0, every existing profile's value, adds no flag, so
  no fingerprint changes and nothing rolls.
- shards.desired_adapters: the adapters (`kind: adapter` documents) the leader placed on the
  shard's engine, sent to its agent beside the launch spec, never in it (protocol.RuntimeAdapter).
- shards.observed_adapters: the engine's runtime adapters as its agent reports them
  (protocol.AdapterObserved); the route table sends an adapter's requests only where one is
  loaded, so its trigger now fires on this column too.
- gateway_demand.requests_per_s: each gateway's recent request rate per name, what the
  placement scales an adapter's holders by.

Revision ID: 0013_runtime_adapters
Revises: 0012_adapters
Create Date: 2026-12-06 03:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0013_runtime_adapters"
down_revision: str | None = "0012_adapters"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The trigger as 0005 created it, and with the new column: a route changes when an adapter
# loads or unloads on a replica.
_TRIGGER_BEFORE = (
    "CREATE TRIGGER shards_notify_routes AFTER INSERT OR DELETE OR UPDATE OF observed_state, "
    "proxy_url, desired_state, released, engine_api_key ON shards "
    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()"
)
_TRIGGER_AFTER = (
    "CREATE TRIGGER shards_notify_routes AFTER INSERT OR DELETE OR UPDATE OF observed_state, "
    "proxy_url, desired_state, released, engine_api_key, observed_adapters ON shards "
    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify_routes()"
)


def upgrade() -> None:
    op.add_column(
        "profiles",
        sa.Column("adapter_slots", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_profiles_adapter_slots_range"),
        "profiles",
        "adapter_slots >= 0 AND adapter_slots <= 1024",
    )
    for column in ("desired_adapters", "observed_adapters"):
        op.add_column(
            "shards",
            sa.Column(
                column,
                postgresql.JSONB(astext_type=sa.Text()),
                server_default=sa.text("'[]'::jsonb"),
                nullable=False,
            ),
        )
    op.add_column(
        "gateway_demand",
        sa.Column("requests_per_s", sa.Float(), server_default=sa.text("0"), nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_gateway_demand_requests_per_s_nonnegative"),
        "gateway_demand",
        "requests_per_s >= 0",
    )
    op.execute("DROP TRIGGER shards_notify_routes ON shards")
    op.execute(_TRIGGER_AFTER)


def downgrade() -> None:
    op.execute("DROP TRIGGER shards_notify_routes ON shards")
    op.execute(_TRIGGER_BEFORE)
    op.drop_constraint(
        op.f("ck_gateway_demand_requests_per_s_nonnegative"), "gateway_demand", type_="check"
    )
    op.drop_column("gateway_demand", "requests_per_s")
    op.drop_column("shards", "observed_adapters")
    op.drop_column("shards", "desired_adapters")
    op.drop_constraint(op.f("ck_profiles_adapter_slots_range"), "profiles", type_="check")
    op.drop_column("profiles", "adapter_slots")
