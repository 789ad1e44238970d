"""Alembic environment: the URL comes from llmgw's settings, never from alembic.ini.

Used by both `alembic upgrade head` (from the repository root) and
`llmgw db upgrade` / `llmgw.store.migrations.upgrade`, which pass the
URL in through the Alembic config's attributes.
"""

from __future__ import annotations

import os

from sqlalchemy import create_engine, pool

from alembic import context
from llmgw.store.tables import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("database_url")
    if url:
        return str(url)
    from llmgw.config import load_settings

    settings = load_settings(os.environ.get("LLMGW_CONFIG") or None)
    if not settings.controlplane.database_url:
        raise SystemExit(
            "no database URL: set LLMGW_CONTROLPLANE__DATABASE_URL (postgresql+psycopg://...) "
            "or point LLMGW_CONFIG at a config file with [controlplane] database_url"
        )
    return settings.controlplane.database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
