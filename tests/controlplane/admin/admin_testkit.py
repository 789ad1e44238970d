"""A real `llmgw controlplane` process on its own migrated database, for the admin API and
CLI tests, plus builders for the rows agents and the reconciler write (nodes with an
inventory, replicas, shards holding GPUs), inserted over SQL as their writers would.

``running_controlplane`` is the suite's one way to start that process (tests/controlplane's
fixtures and the notify hub's test use it); the CLI is driven in-process (typer's runner) against that process over real HTTP.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from typer.testing import CliRunner

from llmgw.cli import app
from llmgw.embedded_postgres import libpq_url as libpq
from tests.pg_harness import PgServer
from tests.support.procs import free_port, llmgw_cmd, stop_process, wait_http_ok

__all__ = [
    "CliResult",
    "ControlPlane",
    "count",
    "insert_node",
    "insert_replica",
    "name",
    "run_cli",
    "running_controlplane",
    "sql",
]


@dataclass(frozen=True)
class ControlPlane:
    url: str
    token: str
    db_url: str
    proc: subprocess.Popen[bytes]
    log: Path
    public_url: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@contextmanager
def running_controlplane(
    pg_server: PgServer, template: str, tmp: Path, *, reconcile: bool = False
) -> Iterator[ControlPlane]:
    """The suite's one way to start a control plane process on a fresh database. The reconcile
    loop is off by default: the admin tests write the reconciler's rows themselves (replicas,
    shards, status), and a live loop would replace or drain them under the assertions."""
    db = pg_server.new_name("cp")
    db_url = pg_server.create_database(db, template=template)
    port, public_port = free_port(), free_port()
    token = secrets.token_urlsafe(24)
    log = tmp / "controlplane.log"
    env = dict(os.environ)
    env.update(
        LLMGW_CONTROLPLANE__DATABASE_URL=db_url,
        LLMGW_CONTROLPLANE__ADMIN_TOKEN=token,
        LLMGW_LOG__JSON="true",
        LLMGW_CONTROLPLANE__RECONCILE__ENABLED=str(reconcile).lower(),
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
        yield ControlPlane(
            url=url,
            token=token,
            db_url=db_url,
            proc=proc,
            log=log,
            public_url=f"http://127.0.0.1:{public_port}",
        )
    finally:
        stop_process(proc)
        pg_server.drop_database(db)


def name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def sql(db_url: str, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        cur = conn.execute(query, params)
        return list(cur.fetchall()) if cur.description else []


def count(db_url: str, table: str, where: str = "TRUE", params: Sequence[Any] = ()) -> int:
    return int(sql(db_url, f"SELECT count(*) FROM {table} WHERE {where}", params)[0][0])


def insert_node(
    db_url: str, node: str, *, gpus: int = 4, mig_parent: bool = False, pool: str = "default"
) -> str:
    """A registered node and its agent's report: ``gpus`` whole sim GPUs (with
    ``mig_parent``, one more GPU with MIG enabled and two instances of it)."""
    devices: list[dict[str, Any]] = [
        {"index": i, "uuid": f"GPU-{node}-{i}", "name": "sim", "gpu_class": "sim"}
        for i in range(gpus)
    ]
    if mig_parent:
        parent = f"GPU-{node}-mig"
        devices.append(
            {"index": gpus, "uuid": parent, "name": "A100", "gpu_class": "A100",
             "mig_enabled": True}
        )  # fmt: skip
        devices += [
            {"index": 1000 + gpus * 100 + k, "uuid": f"MIG-{node}-{k}", "name": "A100 MIG",
             "gpu_class": "A100 MIG 1g.10gb", "mig_parent_uuid": parent}
            for k in range(2)
        ]  # fmt: skip
    node_id = sql(
        db_url,
        "INSERT INTO nodes (name, approval_state, pool) VALUES (%s, 'pending', %s) RETURNING id",
        (node, pool),
    )[0][0]
    sql(
        db_url,
        "INSERT INTO node_status (node_id, mgmt_addr, inventory, agent_version, last_sync_at) "
        "VALUES (%s, '10.0.0.1', %s, '0.1.0', now())",
        (node_id, json.dumps({"gpus": devices, "cpu_threads": 16, "source": "sim"})),
    )
    return str(node_id)


def insert_replica(
    db_url: str,
    deployment: str | None,
    shards: Sequence[tuple[str, Sequence[int]]],
    *,
    fingerprint: str = "fp-old",
    observed_state: str = "ready",
    log_tail: str = "",
    released: bool = False,
) -> str:
    """A replica with one shard per (node id, GPU indices) as the reconciler places them."""
    dep_id = (
        None
        if deployment is None
        else sql(db_url, "SELECT id FROM deployments WHERE name = %s", (deployment,))[0][0]
    )
    replica = sql(
        db_url,
        "INSERT INTO replicas (deployment_id, profile_fingerprint) VALUES (%s, %s) RETURNING id",
        (dep_id, fingerprint),
    )[0][0]
    for rank, (node_id, gpus) in enumerate(shards):
        shard = sql(
            db_url,
            "INSERT INTO shards (replica_id, node_id, rank, profile_fingerprint, observed_state, "
            "log_tail, restarts, exit_code, released) VALUES (%s, %s, %s, %s, %s, %s, 2, %s, %s) "
            "RETURNING id",
            (replica, node_id, rank, fingerprint, observed_state, log_tail,
             1 if observed_state == "failed" else None, released),
        )[0][0]  # fmt: skip
        for position, index in enumerate(gpus):
            sql(
                db_url,
                "INSERT INTO gpu_assignments (shard_id, position, node_id, gpu_index, "
                "shard_released) VALUES (%s, %s, %s, %s, %s)",
                (shard, position, node_id, index, released),
            )
    return str(replica)


@dataclass(frozen=True)
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


def run_cli(cp: ControlPlane, *args: str, stdin: str | None = None) -> CliResult:
    """``llmgw ARGS`` in-process, connected through LLMGW_ADMIN_URL / LLMGW_ADMIN_TOKEN."""
    runner = CliRunner()
    result = runner.invoke(
        app,
        list(args),
        input=stdin,
        env={"LLMGW_ADMIN_URL": cp.url, "LLMGW_ADMIN_TOKEN": cp.token},
        catch_exceptions=False,
    )
    return CliResult(result.exit_code, result.stdout, result.stderr)
