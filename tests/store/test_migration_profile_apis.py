"""Migration 0010_profile_apis on a real Postgres: existing profiles keep serving what they serve
(an empty list, the engine's default), their fingerprints untouched; the database refuses a list
the API would refuse; down and up again."""

from __future__ import annotations

import psycopg
import pytest

from llmgw.embedded_postgres import libpq_url
from llmgw.store import migrations

pytestmark = pytest.mark.timeout(90)

_BEFORE = "0009_profile_tokenizer"


def _profile(conn: psycopg.Connection[tuple[object, ...]], name: str) -> None:
    model = conn.execute(
        "INSERT INTO models (name) VALUES (%s) RETURNING id", (f"{name}-m",)
    ).fetchone()
    assert model is not None
    conn.execute(
        "INSERT INTO profiles (name, model_id, engine, model_path, args, kv_hash_seed, "
        "fingerprint) VALUES (%s, %s, 'vllm', '/m', '[\"--runner\", \"pooling\"]', '12345', "
        "'fp-before')",
        (name, model[0]),
    )


def _columns(url: str) -> set[str]:
    with psycopg.connect(libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'profiles'"
        ).fetchall()
    return {str(r[0]) for r in rows}


def test_existing_profiles_get_the_engines_default_and_down_drops_it(empty_db_url: str) -> None:
    migrations.upgrade(empty_db_url, _BEFORE)
    assert "apis" not in _columns(empty_db_url)
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        _profile(conn, "old")
    migrations.upgrade(empty_db_url, "0010_profile_apis")
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        row = conn.execute("SELECT apis, fingerprint FROM profiles WHERE name = 'old'").fetchone()
        assert row == ([], "fp-before")
        conn.execute("UPDATE profiles SET apis = '{generate,pooling}' WHERE name = 'old'")
        _profile(conn, "new")  # written without the column: its default
        assert conn.execute("SELECT apis FROM profiles WHERE name = 'new'").fetchone() == ([],)
    migrations.downgrade(empty_db_url, _BEFORE)
    assert "apis" not in _columns(empty_db_url)
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        names = conn.execute("SELECT name FROM profiles ORDER BY name").fetchall()
    assert names == [("new",), ("old",)]
    migrations.upgrade(empty_db_url)
    assert migrations.current_revision(empty_db_url) == migrations.head_revision()
    with psycopg.connect(libpq_url(empty_db_url)) as conn:
        rows = conn.execute("SELECT apis FROM profiles").fetchall()
    assert rows == [([],), ([],)]


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        ("{}", True),
        ("{generate}", True),
        ("{pooling}", True),
        ("{generate,pooling}", True),
        ("{pooling,generate}", True),
        ("{generate,generate}", False),
        ("{pooling,generate,pooling}", False),
        ("{embeddings}", False),
        ("{Generate}", False),
        ("{NULL}", False),
        ("{generate,NULL}", False),
        ("{{generate},{pooling}}", False),
    ],
)
def test_the_database_holds_the_rule(db_url: str, value: str, stored: bool) -> None:
    """A list the API refuses is refused by the database too, whoever writes the row (each
    clause of the CHECK must be false, not NULL, for a NULL element)."""
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        _profile(conn, "p")
        update = "UPDATE profiles SET apis = %s::text[] WHERE name = 'p'"
        if stored:
            conn.execute(update, (value,))
            return
        with pytest.raises(psycopg.errors.CheckViolation, match="ck_profiles_apis_known"):
            conn.execute(update, (value,))
        with pytest.raises(psycopg.errors.NotNullViolation):
            conn.execute("UPDATE profiles SET apis = NULL WHERE name = 'p'")
