"""Running and inspecting the Alembic migrations of the state store.

The migrations live in the repository's top-level ``alembic/`` folder, which an
editable or source install has beside the package. This module only drives
Alembic; it never creates tables itself (``metadata.create_all`` would give a
schema no migration produced, and the next upgrade would fail on it).
"""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool

from alembic import command
from llmgw.errors import ConfigError

__all__ = ["alembic_config", "current_revision", "downgrade", "head_revision", "upgrade"]

_ROOT = Path(__file__).resolve().parents[2]


def alembic_config(url: str | None = None) -> Config:
    ini = _ROOT / "alembic.ini"
    if not ini.is_file():
        raise ConfigError(
            f"Alembic migrations not found at {ini.parent / 'alembic'}: llmgw must be installed "
            "from a source checkout (pip install -e .) so its migrations are available"
        )
    cfg = Config(str(ini))
    cfg.set_main_option("script_location", str(_ROOT / "alembic"))
    if url is not None:
        cfg.attributes["database_url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` to ``revision`` (idempotent)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:
        raise ConfigError(
            f"the migrations have {len(heads)} heads ({', '.join(heads)}); merge them"
        )
    return heads[0]


def current_revision(url: str) -> str | None:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
