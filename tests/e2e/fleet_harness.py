"""A whole fleet as real processes on loopback, for the end-to-end tests (docs/architecture.md §10).

Real `llmgw controlplane` processes (each with its internal listener, reconcile loop and
agent API) on one test database, real `llmgw agent --sim-gpus N` processes that run `sim`
engines under `llmgw shard-run`, and the admin API over real HTTP. Nothing is faked but
the GPUs (the agent's ``--sim-gpus`` inventory).

Periods are short so a scenario settles in seconds: agents sync every 0.3 s, the
reconciler ticks every 0.3 s, a draining replica stops after 1 s at the latest. A node
is declared gone after 4 s without a sync: well over 5 sync periods (docs/architecture.md §10), since
on 2 cores shared with other test runs an agent busy starting engines was seen to miss
2 s of syncs, and its replicas were replaced under the test's feet.

What it must not do: leave processes behind. Engines survive their agent on purpose
(docs/architecture.md §4: the agent never takes its engines down with it), so ``close`` signals every
shard's marked processes by the shard ids the database knows, after the agents stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg

from llmgw.embedded_postgres import libpq_url
from llmgw.nodeagent.procs import kill_marked
from tests.nodeagent.agent_harness import AgentProcess
from tests.support.procs import agent_port_base, free_port, llmgw_cmd, stop_process, wait_http_ok
from tests.support.waiting import wait_for

__all__ = [
    "SIM_ARGS",
    "ControlPlaneProc",
    "Fleet",
    "ReadyShard",
    "answers",
    "fleet",
    "pid_alive",
]

T = TypeVar("T")

SYNC_S = 0.3
TICK_S = 0.3
NODE_GRACE_S = 4.0  # > 5 sync periods; see the module docstring
DRAIN_TIMEOUT_S = 1.0

# Fast simulator: answers in milliseconds, tiny KV cache.
SIM_ARGS = ["--time-scale", "0.01", "--num-blocks", "64"]

_CP_ENV = {
    "LLMGW_LOG__JSON": "true",
    "LLMGW_LOG__LEVEL": "info",
    "LLMGW_CONTROLPLANE__RECONCILE__TICK_S": str(TICK_S),
    "LLMGW_CONTROLPLANE__RECONCILE__SYNC_PERIOD_S": str(SYNC_S),
    "LLMGW_CONTROLPLANE__RECONCILE__NODE_GRACE_S": str(NODE_GRACE_S),
    "LLMGW_CONTROLPLANE__RECONCILE__DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
    # A reconciler's change reaches the agent's next sync, not half a second later.
    "LLMGW_CONTROLPLANE__AGENT_API__NODE_REFRESH_S": "0",
    "LLMGW_CONTROLPLANE__AGENT_API__HEARTBEAT_FLUSH_S": "0.2",
    "LLMGW_CONTROLPLANE__AGENT_API__INSTANCE_HEARTBEAT_S": "0.5",
    "LLMGW_CONTROLPLANE__SHUTDOWN_GRACE_S": "2",
}


@dataclass
class ControlPlaneProc:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    public_url: str = ""  # its gateway (the OpenAI API)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metric(self, name: str) -> float | None:
        """One unlabelled sample from /metrics, None when absent."""
        text = httpx.get(f"{self.url}/metrics", timeout=2).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def leads(self) -> bool:
        return self.metric("llmgw_reconcile_leader") == 1.0

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot hear SIGTERM
            stop_process(self.proc, timeout_s=10)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far."""
        out = []
        for line in self.log_text().splitlines():
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if isinstance(ev, dict) and "event" in ev:
                    out.append(ev)
        return out


@dataclass(frozen=True)
class ReadyShard:
    shard_id: str
    replica_id: str
    node: str
    proxy_url: str
    key: str
    pid: int
    fingerprint: str


@dataclass
class Fleet:
    db_url: str
    tmp: Path
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    controlplanes: list[ControlPlaneProc] = field(default_factory=list)
    agents: dict[str, AgentProcess] = field(default_factory=dict)

    # --- processes ------------------------------------------------------------------

    def start_controlplane(
        self,
        name: str,
        *,
        config: Path | None = None,
        unset: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> ControlPlaneProc:
        """``env``: settings on top of the fast defaults; ``unset``: defaults to leave out
        (where the config file sets them: the environment would win over it)."""
        port = free_port()
        log = self.tmp / f"{name}.log"
        full = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        full.update({k: v for k, v in _CP_ENV.items() if k not in unset})
        full.update(
            LLMGW_CONTROLPLANE__DATABASE_URL=self.db_url,
            LLMGW_CONTROLPLANE__ADMIN_TOKEN=self.admin_token,
        )
        full.update(env or {})
        public_port = free_port()
        args = ["--port", str(port), "--public-port", str(public_port)]
        if config is not None:
            args += ["--config", str(config)]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                llmgw_cmd("controlplane", *args),
                env=full,
                stdout=out,
                stderr=out,
            )
        cp = ControlPlaneProc(
            name=name,
            url=f"http://127.0.0.1:{port}",
            proc=proc,
            log=log,
            public_url=f"http://127.0.0.1:{public_port}",
        )
        self.controlplanes.append(cp)
        wait_http_ok(f"{cp.url}/readyz", timeout_s=60, proc=proc, log=log)
        return cp

    @property
    def cp(self) -> ControlPlaneProc:
        """The first control plane still running: where admin calls and agents go."""
        return next(c for c in self.controlplanes if c.alive())

    def start_agent(
        self, node: str, *, gpus: int, pool: str = "default", via: ControlPlaneProc | None = None
    ) -> AgentProcess:
        """``via``: the control plane it registers and syncs with (default: ``cp``)."""
        token = self.token(pool=pool)
        base = agent_port_base()
        agent = AgentProcess(
            state_dir=self.tmp / f"{node}-state",
            controlplane_url=(via or self.cp).url,
            listen_port=free_port(),
            log_path=self.tmp / f"{node}.log",
            port_range=(base, base + 63),
            token=token,
            node_name=node,
            sim_gpus=gpus,
            extra_env={"LLMGW_AGENT__SYNC_INTERVAL_S": str(SYNC_S)},
        ).start()
        self.agents[node] = agent
        self.until(
            lambda: self.sql(
                "SELECT 1 FROM nodes n JOIN node_status s ON s.node_id = n.id "
                "WHERE n.name = %s AND s.last_sync_at IS NOT NULL",
                node,
            ),
            timeout_s=60,
            what=f"agent {node} to register and sync",
        )
        return agent

    def close(self) -> None:
        for agent in self.agents.values():
            with contextlib.suppress(ProcessLookupError):
                if agent.proc is not None:
                    os.kill(agent.proc.pid, signal.SIGCONT)
            agent.terminate()
        for cp in self.controlplanes:
            cp.stop()
        with contextlib.suppress(psycopg.Error):
            for (shard,) in self.sql("SELECT id::text FROM shards"):
                kill_marked(shard)

    # --- the admin API and the database ---------------------------------------------

    def admin(
        self, method: str, path: str, body: Any = None, *, via: ControlPlaneProc | None = None
    ) -> Any:
        r = httpx.request(
            method,
            f"{(via or self.cp).url}/admin/v1{path}",
            json=body,
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=10,
        )
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
        return r.json() if r.content else None

    def token(self, *, pool: str = "default") -> str:
        return str(self.admin("POST", "/bootstrap-tokens", {"pool": pool, "uses": 1})["token"])

    def sim_deployment(
        self,
        name: str,
        *,
        replicas: int,
        max_surge: str = "1",
        max_unavailable: str = "0",
        args: Sequence[str] = SIM_ARGS,
    ) -> None:
        """A model, a one-GPU `sim` profile and a deployment of it, all named ``name``."""
        self.admin("POST", "/models", {"name": name})
        self.admin(
            "POST",
            "/profiles",
            {
                "name": name,
                "model": name,
                "engine": "sim",
                "gpu_class": "sim",
                "model_path": name,
                "args": list(args),
            },
        )
        self.admin(
            "POST",
            "/deployments",
            {
                "name": name,
                "model": name,
                "profile": name,
                "replicas": replicas,
                "max_surge": max_surge,
                "max_unavailable": max_unavailable,
            },
        )

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(libpq_url(self.db_url), autocommit=True) as conn:
            cur = conn.execute(query, params)
            return list(cur.fetchall()) if cur.description else []

    def ready_shards(self, deployment: str) -> list[ReadyShard]:
        """Leader shards of the deployment's active replicas that their agent reports ready."""
        rows = self.sql(
            "SELECT s.id::text, r.id::text, n.name, s.proxy_url, s.engine_api_key, s.pid, "
            "s.profile_fingerprint FROM shards s JOIN replicas r ON r.id = s.replica_id "
            "JOIN deployments d ON d.id = r.deployment_id JOIN nodes n ON n.id = s.node_id "
            "WHERE d.name = %s AND s.rank = 0 AND s.observed_state = 'ready' "
            "AND s.desired_state = 'running' AND NOT s.released AND r.state = 'active' "
            "ORDER BY s.id",
            deployment,
        )
        return [ReadyShard(*row) for row in rows]

    def live_shards(self, deployment: str | None = None) -> list[tuple[str, str, int | None]]:
        """(shard id, replica state, pid) of every unreleased shard."""
        where = "AND d.name = %s" if deployment else ""
        params = (deployment,) if deployment else ()
        return [
            (row[0], row[1], row[2])
            for row in self.sql(
                "SELECT s.id::text, r.state, s.pid FROM shards s "
                "JOIN replicas r ON r.id = s.replica_id "
                "LEFT JOIN deployments d ON d.id = r.deployment_id "
                f"WHERE NOT s.released {where} ORDER BY s.id",
                *params,
            )
        ]

    def wait_ready(self, deployment: str, count: int, *, timeout_s: float) -> list[ReadyShard]:
        """Wait until exactly ``count`` replicas of the deployment are active and ready."""

        def ready() -> list[ReadyShard] | None:
            shards = self.ready_shards(deployment)
            return shards if len(shards) == count else None

        return self.until(ready, timeout_s=timeout_s, what=f"{count} ready replicas")

    def held_gpus(self) -> int:
        return int(self.sql("SELECT count(*) FROM gpu_assignments WHERE NOT shard_released")[0][0])

    # --- waiting ----------------------------------------------------------------------

    def check_alive(self) -> None:
        for name, agent in self.agents.items():
            if agent.proc is not None and agent.proc.returncode is None and not agent.alive():
                raise AssertionError(f"agent {name} exited:\n{agent.log_path.read_text()[-3000:]}")

    def until(self, condition: Callable[[], T | None], *, timeout_s: float, what: str) -> T:
        def probe() -> T | None:
            self.check_alive()
            return condition()

        try:
            got: T = wait_for(probe, timeout_s=timeout_s, what=what, interval_s=0.1)
            return got
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnose()}") from None

    def diagnose(self) -> str:
        """What the database and the last log lines say, for a failure message."""
        out = []
        with contextlib.suppress(Exception):
            for row in self.sql(
                "SELECT r.state, r.reason, s.observed_state, s.observed_reason, s.desired_state, "
                "s.released, n.name FROM shards s JOIN replicas r ON r.id = s.replica_id "
                "JOIN nodes n ON n.id = s.node_id ORDER BY s.created_at"
            ):
                out.append(f"shard {row}")
            for row in self.sql(
                "SELECT epoch, action, deployment, node, reason FROM reconcile_actions "
                "ORDER BY id DESC LIMIT 15"
            ):
                out.append(f"action {row}")
            for row in self.sql("SELECT * FROM deployment_status"):
                out.append(f"status {row}")
        for cp in self.controlplanes:
            with contextlib.suppress(OSError):
                out.append(f"--- {cp.name}:\n" + "\n".join(cp.log_text().splitlines()[-15:]))
        for name, agent in self.agents.items():
            with contextlib.suppress(OSError):
                out.append(
                    f"--- {name}:\n" + "\n".join(agent.log_path.read_text().splitlines()[-10:])
                )
        return "\n".join(out)


def answers(shard: ReadyShard, model: str, *, timeout_s: float = 2.0) -> bool:
    """The engine answers a completion through its agent's proxy with the shard's key."""
    try:
        r = httpx.post(
            f"{shard.proxy_url}/v1/completions",
            json={"model": model, "prompt": "hello", "max_tokens": 2},
            headers={"Authorization": f"Bearer {shard.key}"},
            timeout=timeout_s,
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has not been reaped yet but runs nothing.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


@contextlib.contextmanager
def fleet(db_url: str, tmp: Path) -> Iterator[Fleet]:
    f = Fleet(db_url=db_url, tmp=tmp)
    try:
        yield f
    finally:
        f.close()
