"""A real `llmgw controlplane` process per test module, on its own migrated database."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pg_harness import PgServer
from support.procs import free_port, llmgw_cmd, stop_process, wait_http_ok


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
