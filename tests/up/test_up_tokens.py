"""The agent's bootstrap token `llmgw up` keeps in its data dir: reused while the database
says it has a use left, replaced once spent, revoked or expired, untouched once the agent
registered (it needs none then)."""

from __future__ import annotations

import stat
from pathlib import Path

import psycopg

from llmgw.embedded_postgres import libpq_url
from llmgw.up.bootstrap import ensure_bootstrap_token


def _sql(db_url: str, query: str) -> None:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(query)


def test_the_token_is_reused_until_spent_and_left_alone_once_registered(
    db_url: str, tmp_path: Path
) -> None:
    path = ensure_bootstrap_token(tmp_path, db_url, registered=False)
    assert path == tmp_path / "agent.bootstrap-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text()
    assert first.strip()

    # Still unused: the same token (a first run interrupted before the agent registered).
    assert ensure_bootstrap_token(tmp_path, db_url, registered=False).read_text() == first

    # Spent (the agent registered, then lost its state dir): a new one.
    _sql(db_url, "UPDATE bootstrap_tokens SET uses_left = 0")
    second = ensure_bootstrap_token(tmp_path, db_url, registered=False).read_text()
    assert second != first

    # Revoked, or expired: a new one again.
    _sql(db_url, "UPDATE bootstrap_tokens SET revoked = true")
    third = ensure_bootstrap_token(tmp_path, db_url, registered=False).read_text()
    assert third not in (first, second)
    _sql(db_url, "UPDATE bootstrap_tokens SET expires_at = now() - interval '1 minute'")
    fourth = ensure_bootstrap_token(tmp_path, db_url, registered=False).read_text()
    assert fourth not in (first, second, third)

    # Registered: no token is created or replaced, whatever the database says.
    _sql(db_url, "UPDATE bootstrap_tokens SET uses_left = 0")
    assert ensure_bootstrap_token(tmp_path, db_url, registered=True).read_text() == fourth

    # Each agent of `up` has its own token.
    gpu = ensure_bootstrap_token(tmp_path, db_url, registered=False, name="agent-gpu")
    assert gpu.name == "agent-gpu.bootstrap-token" and gpu.read_text() != fourth
