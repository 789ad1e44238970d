"""The REAL control plane for the node agent's acceptance tests and its bench.

``RealControlPlane`` runs `llmgw controlplane` as a process on a throwaway database, with the
reconciler on and short periods, and can be killed and started again on the same port and
database (a control plane restart: a new instance id, an empty KV index that agents refill
with full copies). Helpers drive it as an operator would: admin API documents, a bootstrap
token, replicas; and read what tests compare: shards' rows and this process's KV view of a
shard (``GET /admin/v1/debug/kv/{shard}``).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psycopg

from llmgw.embedded_postgres import libpq_url
from tests.support.procs import free_port, llmgw_cmd, stop_process, wait_http_ok

__all__ = ["RealControlPlane", "engine_blocks", "kv_agreement", "sim_deployment"]

# Short periods so a test sees the reconciler and the agent API act within a second or two.
FAST_ENV = {
    "LLMGW_CONTROLPLANE__RECONCILE__TICK_S": "0.3",
    "LLMGW_CONTROLPLANE__RECONCILE__SYNC_PERIOD_S": "0.2",
    "LLMGW_CONTROLPLANE__RECONCILE__NODE_GRACE_S": "60",
    # A scaled-down replica drains this long before it is stopped (no router sends it work).
    "LLMGW_CONTROLPLANE__RECONCILE__DRAIN_TIMEOUT_S": "1",
    "LLMGW_CONTROLPLANE__AGENT_API__HEARTBEAT_FLUSH_S": "0.2",
    "LLMGW_CONTROLPLANE__AGENT_API__INSTANCE_HEARTBEAT_S": "0.5",
    "LLMGW_CONTROLPLANE__AGENT_API__PLACED_REFRESH_S": "0.5",
    "LLMGW_CONTROLPLANE__AGENT_API__NODE_REFRESH_S": "0",
    "LLMGW_LOG__JSON": "true",
}


def sim_deployment(
    name: str, *, replicas: int, kv_events: bool = True, num_blocks: int = 64
) -> list[dict[str, Any]]:
    """Admin API documents: a model, a `sim` profile on sim GPUs, a deployment of it."""
    return [
        {"kind": "model", "name": name},
        {"kind": "profile", "name": f"{name}-sim", "model": name, "engine": "sim",
         "gpu_class": "sim", "model_path": name, "kv_events": kv_events,
         "args": ["--time-scale", "0.01", "--num-blocks", str(num_blocks)]},
        {"kind": "deployment", "name": name, "model": name, "profile": f"{name}-sim",
         "replicas": replicas},
    ]  # fmt: skip


def engine_blocks(http_port: int) -> Counter[tuple[int, str]] | None:
    """An engine's own physical blocks by (hash, medium); None while requests still run."""
    state = httpx.get(f"http://127.0.0.1:{http_port}/debug/kv_blocks", timeout=5).json()
    if state["counts"]["running"] or state["counts"]["waiting"]:
        return None
    return Counter((b["hash"], b["medium"]) for b in state["blocks"])


class RealControlPlane:
    """`llmgw controlplane` on ``db_url``; ``kill``/``start`` keep its port and database."""

    def __init__(self, db_url: str, log_path: Path, *, extra_env: dict[str, str] | None = None):
        self.db_url = db_url
        self.log_path = log_path
        self.port, self.public_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(24)
        env = dict(os.environ)
        env.update(FAST_ENV)
        env.update(
            LLMGW_CONTROLPLANE__DATABASE_URL=db_url,
            LLMGW_CONTROLPLANE__ADMIN_TOKEN=self.token,
        )
        env.update(extra_env or {})
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin = httpx.Client(
            base_url=f"{self.url}/admin/v1",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )

    # --- the process ----------------------------------------------------------------------

    def start(self, timeout_s: float = 30) -> RealControlPlane:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                llmgw_cmd(
                    "controlplane", "--port", str(self.port), "--public-port", str(self.public_port)
                ),
                env=self.env,
                stdout=out,
                stderr=out,
            )
        wait_http_ok(f"{self.url}/readyz", timeout_s=timeout_s, proc=self.proc, log=self.log_path)
        return self

    def kill(self) -> None:
        """SIGKILL: nothing is handed over, its KV index is simply gone."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc)
        self.admin.close()

    def assert_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"control plane exited:\n{self.log_path.read_text()[-4000:]}")

    # --- as an operator -------------------------------------------------------------------

    def apply(self, docs: list[dict[str, Any]]) -> None:
        r = self.admin.post("/apply", json={"documents": docs})
        assert r.status_code == 200, r.text

    def bootstrap_token(self, *, pool: str = "default", uses: int = 1) -> str:
        r = self.admin.post("/bootstrap-tokens", json={"pool": pool, "uses": uses})
        assert r.status_code == 201, r.text
        token: str = r.json()["token"]
        return token

    def kv_view(self, shard_id: str) -> dict[str, Any] | None:
        """This process's KV index for the shard (None: it holds nothing for it)."""
        r = self.admin.get(f"/debug/kv/{shard_id}")
        if r.status_code == 404:
            return None
        assert r.status_code == 200, r.text
        view: dict[str, Any] = r.json()
        return view

    def sql(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(libpq_url(self.db_url), autocommit=True) as conn:
            cur = conn.execute(query, params)
            return list(cur.fetchall()) if cur.description else []

    def shards(self, deployment: str) -> list[dict[str, Any]]:
        """The deployment's shards desired running: id, observed state, pid, port, restarts."""
        rows = self.sql(
            "SELECT s.id, s.observed_state, s.pid, s.http_port, s.restarts "
            "FROM shards s JOIN replicas r ON r.id = s.replica_id "
            "JOIN deployments d ON d.id = r.deployment_id "
            "WHERE d.name = %s AND s.desired_state = 'running' ORDER BY s.id",
            (deployment,),
        )
        return [
            {"id": str(r[0]), "state": r[1], "pid": r[2], "http_port": r[3], "restarts": r[4]}
            for r in rows
        ]


def kv_agreement(cp: RealControlPlane, shard_id: str, http_port: int) -> str | None:
    """None when the control plane's view of the shard equals the engine's block set (and is
    complete and not partial); else what differs, for the timeout message."""
    engine = engine_blocks(http_port)
    if engine is None:
        return "engine busy"
    view = cp.kv_view(shard_id)
    if view is None:
        return "control plane holds no view"
    want: dict[str, list[int]] = {}
    for h, medium in engine:
        want.setdefault(medium, []).append(h)
    want = {m: sorted(h) for m, h in want.items()}
    if view["blocks"] != want:
        have = {m: len(h) for m, h in view["blocks"].items()}
        engine_has = {m: len(h) for m, h in want.items()}
        return f"control plane {have} != engine {engine_has}"
    if not engine:
        return "the engine holds no blocks: nothing would be compared"
    if view["partial"] or not view["complete"]:
        return f"control plane view partial={view['partial']} complete={view['complete']}"
    return None
