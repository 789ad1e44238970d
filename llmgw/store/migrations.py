"""Running and inspecting the Alembic migrations of the state store.

The migrations live in the repository's top-level ``alembic/`` folder; a wheel carries the
same files as ``llmgw._alembic`` (setup.py maps them), so a checkout and an installed llmgw
both find them. This module only drives Alembic; it never creates tables itself
(``metadata.create_all`` would give a schema no migration produced, and the next upgrade
would fail on it).
"""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool

from alembic import command
from llmgw.errors import ConfigError

__all__ = [
    "alembic_config",
    "current_revision",
    "downgrade",
    "head_revision",
    "script_location",
    "upgrade",
]

_PACKAGE = Path(__file__).resolve().parents[1]
# In a checkout (or an editable install of one): <root>/llmgw/store/migrations.py.
_ROOT = _PACKAGE.parent


def script_location() -> Path:
    """The folder holding env.py and versions/: the wheel's copy, else the checkout's."""
    for candidate in (_PACKAGE / "_alembic", _ROOT / "alembic"):
        # env.py and versions/ together: site-packages/alembic (the library itself) is no match.
        if (candidate / "env.py").is_file() and (candidate / "versions").is_dir():
            return candidate
    raise ConfigError(
        f"Alembic migrations not found (looked in {_PACKAGE / '_alembic'} and "
        f"{_ROOT / 'alembic'}): this llmgw was installed from a build without them; "
        "reinstall from a wheel built by `pip wheel .` (or `pip install -e .` in a checkout)"
    )


def alembic_config(url: str | None = None) -> Config:
    location = script_location()
    # The checkout's alembic.ini, when there, keeps `alembic revision` naming files as the
    # project does; an installed llmgw needs nothing from it (env.py takes the URL from us).
    ini = location.parent / "alembic.ini"
    cfg = Config(str(ini)) if location == _ROOT / "alembic" and ini.is_file() else Config()
    cfg.set_main_option("script_location", str(location))
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
