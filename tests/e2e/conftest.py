"""Fixtures of the end-to-end tests: a fleet of real processes on a fresh database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fleet_harness import Fleet, fleet


@pytest.fixture
def sim_fleet(db_url: str, tmp_path: Path) -> Iterator[Fleet]:
    with fleet(db_url, tmp_path) as f:
        yield f
