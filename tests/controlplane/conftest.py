"""Fixtures of the admin API's tests: one real control plane per module, on its own database
from the migrated template, and an admin client authenticated against it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from admin_testkit import ControlPlane, running_controlplane
from pg_harness import PgServer


@pytest.fixture(scope="module")
def cp(
    pg_server: PgServer, _pg_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    with running_controlplane(pg_server, _pg_template, tmp_path_factory.mktemp("cp")) as c:
        yield c


@pytest.fixture
def client(cp: ControlPlane) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{cp.url}/admin/v1", headers=cp.headers, timeout=10) as c:
        yield c
