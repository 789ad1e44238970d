"""Fixtures of the end-to-end tests: a fleet of real processes on a fresh database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.fleet_harness import Fleet, fleet
from tests.support.e2e_guard import spawns_processes


@pytest.fixture
@spawns_processes
def sim_fleet(db_url: str, tmp_path: Path) -> Iterator[Fleet]:
    with fleet(db_url, tmp_path) as f:
        yield f
