"""URL passwords are hidden wherever config errors quote a value, and only passwords."""

from __future__ import annotations

import pytest

from llmgw.config.loading import _hide_password


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql+psycopg://u:s3cret@h:5432/db", "postgresql+psycopg://u:***@h:5432/db"),
        # An unescaped "@" in the password: hidden whole (the old pattern showed "ss").
        ("postgresql://u:p@ss@host/db", "postgresql://u:***@host/db"),
        ("value postgresql://u:pw@h/db: must start", "value postgresql://u:***@h/db: must start"),
        ("postgresql://h/db", "postgresql://h/db"),
        ("plain text: no URL", "plain text: no URL"),
    ],
)
def test_hide_password(text: str, shown: str) -> None:
    assert _hide_password(text) == shown
