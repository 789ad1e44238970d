"""`llmgw up`'s start sequence: the all-in-one deployment on one machine, from the data
dir's lock to the children running, and its stop in the reverse order.

A private Postgres in the data dir, migrated to head, then `llmgw controlplane` (without its
public listener), `llmgw gateway` (the OpenAI API on --port in processes of its own, so a flood
on it cannot delay syncs or operators; --gateway-workers 0: the control plane serves it, as
before) and `llmgw agent` as child processes, each supervised on its own (supervision.py): one
that dies is restarted alone, with growing pauses (the agent adopts the engines that kept running). The
agent registers with a bootstrap token `up` creates, offers `--sim-gpus` simulated GPUs, and
runs the demo (config/demo.yaml, applied once unless --no-demo) on the simulator. What
follows the start, up to the announcement and up.json, is bringup.py's.

Only the public listener (--host/--port) may face the network; the admin API stays on
controlplane.internal_host (127.0.0.1 by default). Ctrl-C (SIGINT), SIGTERM or SIGHUP
stops engines, agent, control plane and Postgres in that order; a second run reuses the
data dir, its tokens, key and everything stored. Children die with `up` (parent-death
signal), and a run that finds children a killed `up` left (children.json) stops them
before starting its own, so two agents never share one state dir.

What it must not do: hold the only copy of anything (all state is in Postgres or the data
dir), or start over a data dir another `llmgw up` holds.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.embedded_postgres import (
    DataDirInUseError,
    EmbeddedPostgres,
    libpq_url,
)
from llmgw.errors import ConfigError, ConflictError
from llmgw.logs import get_logger
from llmgw.up import bootstrap as api
from llmgw.up import children as procs
from llmgw.up.bringup import UP_JSON, BringUp
from llmgw.up.children import Child
from llmgw.up.options import UpOptions
from llmgw.up.supervision import postgres_alive, restart_dead

__all__ = ["AllInOne", "load_or_create_admin_token"]

log = get_logger("llmgw.up")

_ADMIN_TOKEN_FILE = "admin_token"
# The agent stops its engines before it exits (--stop-engines-on-exit): each gets its
# SIGTERM grace (agent.stop_grace_s) before the wrapper escalates.
_AGENT_STOP_TIMEOUT_S = 60.0
_CONTROLPLANE_STOP_TIMEOUT_S = 20.0
# A single machine syncs every second: startup waits on syncs, and one node costs nothing.
_SYNC_S = "1.0"
_TICK_S = 0.25


def load_or_create_admin_token(data_dir: Path) -> str:
    path = data_dir / _ADMIN_TOKEN_FILE
    if path.is_file():
        token = path.read_text().strip()
        if len(token) >= 16:
            return token
        raise ConfigError(
            f"{path} holds a token shorter than 16 characters; delete the file to have a new one "
            "generated (clients using the old token will need the new one)"
        )
    token = secrets.token_urlsafe(32)
    api.write_private(path, token + "\n")
    return token


def _kept_port(path: Path) -> int:
    """The port recorded in ``path`` while it is still free, else a new free one (recorded)."""
    try:
        port = int(path.read_text().strip())
    except (OSError, ValueError):
        port = 0
    if port:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                pass  # taken by something else since: pick another
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    path.write_text(f"{port}\n")
    return port


class AllInOne:
    """One `llmgw up` run: ``run()`` starts everything, supervises it until ``request_stop``
    (a signal handler), then stops it all; ``say`` gets progress, ``show`` the announcement."""

    def __init__(
        self,
        opts: UpOptions,
        *,
        say: Callable[[str], None] = print,
        show: Callable[[str], None] = print,
    ) -> None:
        self.opts = opts
        self._say = say  # progress, to stderr
        self._show = show  # the announcement, to stdout
        self._stop = threading.Event()
        self._pg: EmbeddedPostgres | None = None
        self._children: dict[str, Child] = {}
        # Per agent child: its node's name and where its /metrics answers (bringup prints it).
        self._agent_metrics: dict[str, tuple[str, str]] = {}
        self._t0 = time.monotonic()

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run(self) -> int:
        opts = self.opts
        opts.data_dir.mkdir(parents=True, exist_ok=True)
        with procs.data_dir_lock(opts.data_dir):
            return self._run_locked()

    def _check_ports(self) -> None:
        opts = self.opts
        if not 1 <= opts.admin_port <= 65535:
            raise ConfigError(
                f"admin port {opts.admin_port} is outside 1-65535 (it defaults to --port + 1); "
                "pass --admin-port",
                field="--admin-port",
            )
        if opts.port == opts.admin_port:
            raise ConfigError(
                f"--port and --admin-port are both {opts.port}; the public and the internal "
                "listener need a port each",
                field="--admin-port",
            )
        for host, host_field, port, flag in (
            (opts.host, "--host", opts.port, "--port"),
            (opts.internal_host, "controlplane.internal_host", opts.admin_port, "--admin-port"),
        ):
            if not procs.port_free(host, port, field=host_field):
                raise ConflictError(
                    f"port {port} on {host} is in use; pick another with {flag} "
                    "(or stop what holds it)",
                    field=flag,
                )

    def _run_locked(self) -> int:
        opts = self.opts
        stale = opts.data_dir / UP_JSON
        if stale.exists():
            # We hold the lock, so whoever wrote it is gone without cleaning up.
            log.warning("previous_run_not_stopped_cleanly", up_json=str(stale))
            stale.unlink()
        procs.stop_leftovers(opts.data_dir, self._say)
        self._check_ports()
        token = load_or_create_admin_token(opts.data_dir)
        self._pg = EmbeddedPostgres(opts.data_dir, progress=self._say, stop_with_owner=True)
        try:
            self._pg.start()
        except DataDirInUseError as exc:
            raise ConflictError(
                f"{exc.message}\nAnother `llmgw up` (or a Postgres) uses {opts.data_dir}; stop it, "
                "or use another --data-dir",
                field="--data-dir",
            ) from None
        try:
            from llmgw.store import migrations

            # The superuser only prepares what a non-superuser cannot; everything after runs as
            # the app role, migrations included, so the tables are the role's own.
            _create_extensions(self._pg.url)
            url = self._pg.app_url
            # Each step checks for Ctrl-C first: a stop asked for during start-up must not be
            # answered with "llmgw is up" and an up.json pointing at a server about to stop.
            if not self._stop.is_set():
                self._say("Migrating the state store ...")
                migrations.upgrade(url)
            if not self._stop.is_set():
                self._start_children(url, token)
                self._supervise(token)
        finally:
            (opts.data_dir / UP_JSON).unlink(missing_ok=True)
            self._stop_children()
            self._pg.stop()
            (opts.data_dir / procs.CHILDREN_JSON).unlink(missing_ok=True)
            self._say("Stopped.")
        return 0

    # --- children -------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        # Settings the user gave through LLMGW_* variables reach the children too; ours win.
        env = dict(os.environ)
        env["LLMGW_LOG__LEVEL"] = self.opts.log_level
        env["LLMGW_LOG__JSON"] = "true"  # the children write to log files
        return env

    def _start_children(self, url: str, token: str) -> None:
        opts = self.opts
        logs = opts.data_dir / "logs"
        logs.mkdir(mode=0o700, exist_ok=True)
        cp_env = self._env()
        cp_env["LLMGW_CONTROLPLANE__DATABASE_URL"] = url
        cp_env["LLMGW_CONTROLPLANE__ADMIN_TOKEN"] = token
        cp_env["LLMGW_CONTROLPLANE__RECONCILE__SYNC_PERIOD_S"] = _SYNC_S
        cp_argv = [
            sys.executable, "-m", "llmgw", "controlplane",
            "--public-host", opts.host, "--public-port", str(opts.port),
            "--host", opts.internal_host, "--port", str(opts.admin_port),
        ]  # fmt: skip
        if opts.gateway_workers:
            cp_argv.append("--no-public-listener")
        if opts.config_path is not None:
            cp_argv += ["--config", str(opts.config_path)]
        cp = Child(
            "controlplane", cp_argv, cp_env, logs / "controlplane.log", _CONTROLPLANE_STOP_TIMEOUT_S
        )
        self._children["controlplane"] = cp
        cp.start()
        procs.record_children(self.opts.data_dir, list(self._children.values()))
        if opts.gateway_workers:
            gw = self._gateway_child(url, logs / "gateway.log")
            self._children["gateway"] = gw
            gw.start()
            procs.record_children(self.opts.data_dir, list(self._children.values()))

        # The token is written into the database directly, so the agents start while the
        # control plane is still importing (they retry registration until the API answers).
        for agent in self._agent_children(url):
            self._children[agent.name] = agent
            agent.start()
            procs.record_children(self.opts.data_dir, list(self._children.values()))

    def _gateway_child(self, url: str, log_path: Path) -> Child:
        """`llmgw gateway`: the OpenAI API on --host/--port, apart from the control plane; its
        private listener (KV deltas from the agents) on the internal host, a free port each
        worker, registered in the database so the agents find it."""
        opts = self.opts
        env = self._env()
        env["LLMGW_CONTROLPLANE__DATABASE_URL"] = url
        argv = [
            sys.executable, "-m", "llmgw", "gateway",
            "--host", opts.host, "--port", str(opts.port),
            "--private-host", opts.internal_host, "--private-port", "0",
            "--workers", str(opts.gateway_workers),
        ]  # fmt: skip
        if opts.config_path is not None:
            argv += ["--config", str(opts.config_path)]
        return Child("gateway", argv, env, log_path, _CONTROLPLANE_STOP_TIMEOUT_S)

    def _agent_children(self, url: str) -> list[Child]:
        """One agent for the simulated GPUs, one for this machine's real ones (NVML).

        The agent reads its GPUs from one source, so real and simulated GPUs are two nodes:
        `<host>-sim` and `<host>`, each with its own state dir and bootstrap token, and
        disjoint engine and front door port ranges (they would otherwise race for the same
        free port).
        """
        from llmgw.nodeagent.state import AgentState

        opts = self.opts
        host = socket.gethostname()
        # (name, simulated GPUs, node, engine ports, front door ports): the engine ranges are
        # those of earlier releases, so shards recorded by them keep their ports.
        wanted: list[tuple[str, int, str, str, str]] = []
        if opts.sim_gpus > 0:
            wanted.append(("agent", opts.sim_gpus, f"{host}-sim", "25000-29999", "19500-19999"))
        if opts.sim_gpus == 0 or procs.nvml_gpu_count() > 0:
            wanted.append(("agent-gpu", 0, host, "20000-24999", "19000-19499"))
        children = []
        for name, sim_gpus, node_name, ports, proxy_ports in wanted:
            state_dir = opts.data_dir / name
            registered = AgentState(state_dir).load_identity() is not None
            token_file = api.ensure_bootstrap_token(
                opts.data_dir, url, registered=registered, name=name
            )
            env = self._env()
            # Each shard's front door is served by its own wrapper, on a port from the proxy
            # range kept with the shard. The agent's shared proxy serves only shards adopted
            # from an earlier release's wrappers; its port is chosen once and kept in the data
            # dir, so their URLs survive an agent restart. Not the default 9401: a second
            # `up`, or a fleet agent, may hold it.
            env.setdefault(
                "LLMGW_AGENT__PROXY_PORT", str(_kept_port(opts.data_dir / f"{name}.proxy_port"))
            )
            env["LLMGW_AGENT__PORT_RANGE_START"], env["LLMGW_AGENT__PORT_RANGE_END"] = ports.split(
                "-"
            )
            (
                env["LLMGW_AGENT__PROXY_PORT_RANGE_START"],
                env["LLMGW_AGENT__PROXY_PORT_RANGE_END"],
            ) = proxy_ports.split("-")
            env["LLMGW_AGENT__SYNC_INTERVAL_S"] = _SYNC_S
            # Its /metrics port is chosen and kept the same way: a scrape target that survives
            # the agent's restarts and the next `up`; bringup prints it and puts it in up.json,
            # since nothing else would say where it is.
            metrics_port = _kept_port(opts.data_dir / f"{name}.metrics_port")
            self._agent_metrics[name] = (node_name, opts.agent_metrics_url(metrics_port))
            # One agent next to its control plane: retry a refused sync within a second (the
            # control plane starts alongside it), and see an engine become ready within half
            # a second; both would be wasteful across a thousand nodes, not on one.
            env.setdefault("LLMGW_AGENT__SYNC_BACKOFF_MAX_S", "1.0")
            env.setdefault("LLMGW_AGENT__HEALTH_INTERVAL_S", "0.5")
            argv = [
                sys.executable, "-m", "llmgw", "agent",
                "--controlplane-url", self.opts.admin_url,
                "--bootstrap-token-file", str(token_file),
                "--state-dir", str(state_dir),
                "--node-name", node_name,
                "--listen-port", str(metrics_port),
                "--stop-engines-on-exit",
            ]  # fmt: skip
            if sim_gpus:
                argv += ["--sim-gpus", str(sim_gpus)]
            if opts.config_path is not None:
                argv += ["--config", str(opts.config_path)]
            log_path = opts.data_dir / "logs" / f"{name}.log"
            children.append(Child(name, argv, env, log_path, _AGENT_STOP_TIMEOUT_S))
        return children

    def _stop_children(self) -> None:
        # The gateway first: it stops taking requests and finishes those open while the
        # engines still answer.
        gateway = self._children.get("gateway")
        if gateway is not None:
            gateway.stop()
        agents = [c for name, c in self._children.items() if name.startswith("agent")]
        if any(a.alive() for a in agents):
            self._say("Stopping engines and the agent ...")
        # Each agent stops its engines first (--stop-engines-on-exit); together, not in turn.
        for a in agents:
            if a.popen is not None and a.popen.poll() is None:
                a.popen.send_signal(signal.SIGTERM)
        for a in agents:
            a.stop()
        for name in ("agent", "agent-gpu"):
            procs.stop_orphan_engines(self.opts.data_dir / name)
        cp = self._children.get("controlplane")
        if cp is not None:
            if cp.alive():
                self._say("Stopping the control plane ...")
            cp.stop()

    # --- the loop ------------------------------------------------------------------------------

    def _supervise(self, token: str) -> None:
        """Restart children that die; meanwhile bring the system up step by step, each step
        retried on the next tick while what it needs is not there yet."""
        pg = self._pg
        assert pg is not None
        steps = BringUp(
            self.opts,
            token,
            controlplane=self._children["controlplane"],
            pg=pg,
            say=self._say,
            show=self._show,
            started_at=self._t0,
            agent_metrics=list(self._agent_metrics.values()),
        )
        while not self._stop.wait(_TICK_S):
            if not postgres_alive(pg, self._stop):
                continue
            restart_dead(self._children, self.opts.data_dir, self._say, announced=steps.announced)
            steps.step()


def _create_extensions(superuser_url: str) -> None:
    # btree_gist backs the GPU-assignment exclusion constraint (migration 0002). It is a
    # trusted extension, so the database's owner could create it too; creating it here as the
    # superuser keeps migrations working on servers where it is not (and costs nothing).
    import psycopg

    with psycopg.connect(libpq_url(superuser_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS btree_gist")
