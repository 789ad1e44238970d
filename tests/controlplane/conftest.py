"""Fixtures of the control plane's tests: a real `llmgw controlplane` process (admin_testkit's
``ControlPlane``), on its own database from the migrated template, per test module, in two
shapes: ``controlplane`` (the reconcile loop on) and ``cp`` (off: the admin tests write the
reconciler's rows themselves), with ``client``, an admin client authenticated against ``cp``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.controlplane.admin.admin_testkit import ControlPlane, running_controlplane
from tests.pg_harness import PgServer
from tests.support.e2e_guard import spawns_processes


@pytest.fixture(scope="module")
@spawns_processes
def controlplane(
    pg_server: PgServer, _pg_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    # The reconcile loop on, as a control plane runs.
    tmp = tmp_path_factory.mktemp("cp")
    with running_controlplane(pg_server, _pg_template, tmp, reconcile=True) as c:
        yield c


@pytest.fixture(scope="module")
@spawns_processes
def cp(
    pg_server: PgServer, _pg_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    with running_controlplane(pg_server, _pg_template, tmp_path_factory.mktemp("cp")) as c:
        yield c


@pytest.fixture
def client(cp: ControlPlane) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{cp.url}/admin/v1", headers=cp.headers, timeout=10) as c:
        yield c
