"""Migration 0012_adapters on a real Postgres: existing profiles and their static adapters come
through untouched; the new table holds its rules itself (name, path, replica bounds, its base
model RESTRICTed); a write to it NOTIFYs the gateways' route caches; down and up again."""

from __future__ import annotations

import psycopg
import pytest

from llmgw.embedded_postgres import libpq_url
from llmgw.store import migrations

pytestmark = pytest.mark.timeout(90)

_BEFORE = "0011_response_id_secret"
_REVISION = "0012_adapters"
_STATIC = '[{"name": "sql-static", "path": "/adapters/sql"}]'


def _tables(url: str) -> set[str]:
    with psycopg.connect(libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchall()
    return {str(r[0]) for r in rows}


def _profile_row(url: str) -> tuple[object, ...] | None:
    with psycopg.connect(libpq_url(url)) as conn:
        return conn.execute(
            "SELECT adapters, fingerprint, version FROM profiles WHERE name = 'old'"
        ).fetchone()


def test_up_keeps_static_adapters_then_down_drops_only_the_table(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url, _BEFORE)
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        model = conn.execute("INSERT INTO models (name) VALUES ('base') RETURNING id").fetchone()
        assert model is not None
        conn.execute(
            "INSERT INTO profiles (name, model_id, engine, model_path, adapters, kv_hash_seed, "
            "fingerprint) VALUES ('old', %s, 'sim', '/m', %s, '12345', 'fp-before')",
            (model[0], _STATIC),
        )
    before = _profile_row(empty_db_url)
    assert "adapters" not in _tables(empty_db_url)

    migrations.upgrade(empty_db_url, _REVISION)
    assert _profile_row(empty_db_url) == before
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        conn.execute("INSERT INTO adapters (name, model, path) VALUES ('sql', 'base', '/a')")
        row = conn.execute(
            "SELECT min_replicas, max_replicas, pinned, description, version FROM adapters"
        ).fetchone()
        assert row == (None, None, False, "", 1)

    migrations.downgrade(empty_db_url, _BEFORE)
    assert "adapters" not in _tables(empty_db_url)
    assert _profile_row(empty_db_url) == before
    migrations.upgrade(empty_db_url)
    assert migrations.current_revision(empty_db_url) == migrations.head_revision()
    assert _profile_row(empty_db_url) == before


@pytest.mark.parametrize(
    ("columns", "error"),
    [
        ("(name, model, path) VALUES ('a', 'base', '')", psycopg.errors.CheckViolation),
        ("(name, model, path) VALUES ('bad name', 'base', '/a')", psycopg.errors.CheckViolation),
        (
            "(name, model, path, min_replicas) VALUES ('a', 'base', '/a', -1)",
            psycopg.errors.CheckViolation,
        ),
        (
            "(name, model, path, max_replicas) VALUES ('a', 'base', '/a', 0)",
            psycopg.errors.CheckViolation,
        ),
        (
            "(name, model, path, min_replicas, max_replicas) VALUES ('a', 'base', '/a', 3, 2)",
            psycopg.errors.CheckViolation,
        ),
        ("(name, model, path) VALUES ('a', 'missing', '/a')", psycopg.errors.ForeignKeyViolation),
        ("(name, model, path) VALUES ('dup', 'base', '/a')", psycopg.errors.UniqueViolation),
    ],
)
def test_the_database_holds_the_rules(db_url: str, columns: str, error: type[Exception]) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute("INSERT INTO models (name) VALUES ('base')")
        conn.execute("INSERT INTO adapters (name, model, path) VALUES ('dup', 'base', '/a')")
        # Null on either side of the bounds, or max = min, is fine.
        conn.execute(
            "INSERT INTO adapters (name, model, path, min_replicas, max_replicas) "
            "VALUES ('ok1', 'base', '/a', 0, NULL), ('ok2', 'base', '/a', NULL, 1), "
            "('ok3', 'base', '/a', 2, 2)"
        )
        with pytest.raises(error):
            conn.execute(f"INSERT INTO adapters {columns}")


def test_a_model_with_adapters_is_not_deleted_and_writes_notify_routes(db_url: str) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute("INSERT INTO models (name) VALUES ('base')")
        conn.execute("LISTEN llmgw_routes_changed")
        conn.execute("INSERT INTO adapters (name, model, path) VALUES ('sql', 'base', '/a')")
        conn.execute("UPDATE adapters SET pinned = true")
        # A description is not routed by: no notification.
        conn.execute("UPDATE adapters SET description = 'words'")
        conn.execute("DELETE FROM adapters WHERE name = 'nothing'")
        payloads = [n.payload for n in conn.notifies(timeout=2, stop_after=4)]
        assert payloads == ["adapters", "adapters", "adapters"]
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            conn.execute("DELETE FROM models WHERE name = 'base'")
        conn.execute("DELETE FROM adapters")
        conn.execute("DELETE FROM models WHERE name = 'base'")
