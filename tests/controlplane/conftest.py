"""Fixtures of the control plane's tests: a real `llmgw controlplane` process, on its own
database from the migrated template, per test module, in two shapes: ``controlplane`` (a
``RunningControlPlane``, its public listener's URL too) and ``cp`` (admin_testkit's
``ControlPlane``), with ``client``, an admin client authenticated against ``cp``."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.controlplane.admin.admin_testkit import ControlPlane, running_controlplane
from tests.pg_harness import PgServer
from tests.support.e2e_guard import spawns_processes
from tests.support.procs import free_port, llmgw_cmd, stop_process, wait_http_ok


@dataclass(frozen=True)
class RunningControlPlane:
    url: str
    token: str
    db_url: str
    proc: subprocess.Popen[bytes]
    log: Path
    public_url: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
@spawns_processes
def controlplane(
    pg_server: PgServer, _pg_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningControlPlane]:
    name = pg_server.new_name("cp")
    db_url = pg_server.create_database(name, template=_pg_template)
    port = free_port()
    public_port = free_port()
    token = secrets.token_urlsafe(24)
    log = tmp_path_factory.mktemp("cp") / "controlplane.log"
    env = dict(os.environ)
    env.update(
        LLMGW_CONTROLPLANE__DATABASE_URL=db_url,
        LLMGW_CONTROLPLANE__ADMIN_TOKEN=token,
        LLMGW_LOG__JSON="true",
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            llmgw_cmd("controlplane", "--port", str(port), "--public-port", str(public_port)),
            env=env,
            stdout=out,
            stderr=out,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/readyz", timeout_s=30, proc=proc, log=log)
        yield RunningControlPlane(
            url=url,
            token=token,
            db_url=db_url,
            proc=proc,
            log=log,
            public_url=f"http://127.0.0.1:{public_port}",
        )
    finally:
        stop_process(proc)
        pg_server.drop_database(name)


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
