"""`llmgw up`: the all-in-one deployment on one machine.

A private Postgres in the data dir, migrated to head, then the control plane as
a child process (so it can fail and be restarted on its own; the node agent
and the demo model on the simulator join it as later pieces land). Both are
supervised: a control plane or a Postgres that dies is restarted with backoff.
Only the public listener (--host/--port) may face the network; the admin API
stays on controlplane.internal_host (127.0.0.1 by default). Ctrl-C
(SIGINT) or SIGTERM stops the children, then Postgres, cleanly; a second run
reuses the data dir, its admin token and everything stored.

What it must not do: hold the only copy of anything (all state is in Postgres
or the data dir), or start over a data dir another `llmgw up` holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy.engine import URL, make_url

from llmgw.embedded_postgres import (
    DataDirInUseError,
    EmbeddedPostgres,
    die_with_parent,
    libpq_url,
)
from llmgw.errors import ConfigError, ConflictError, EngineStartError
from llmgw.logs import get_logger

__all__ = ["AllInOne", "UpOptions"]

log = get_logger("llmgw.up")

_ADMIN_TOKEN_FILE = "admin_token"
_UP_JSON = "up.json"
_CHILD_READY_TIMEOUT_S = 60.0
# A child that keeps dying is restarted with growing pauses, not in a hot loop.
_RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class UpOptions:
    data_dir: Path
    host: str
    port: int  # the public listener: OpenAI endpoint (served once the gateway lands)
    admin_port: int  # the control plane's internal listener: admin API, health
    demo: bool
    log_level: str
    config_path: Path | None
    # The internal listener's address. Never --host: the admin token can set engine argv on
    # every node, so publishing the OpenAI port must not publish the admin API with it.
    internal_host: str = "127.0.0.1"


def _port_free(host: str, port: int, *, field: str = "--host") -> bool:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"{field} {host!r} does not resolve ({exc})", field=field) from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError:
            return False
    return True


def _write_private(path: Path, content: str) -> None:
    """Write a file only its owner can read, atomically (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(content)
    os.replace(tmp, path)


@contextlib.contextmanager
def _data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the data dir for the life of one `llmgw up`.

    Checked first, before ports or Postgres: a second `llmgw up` on the same data
    dir is told exactly that, with the holder's pid, instead of tripping over a
    port or a server the first one owns. The kernel drops the lock when the
    process dies, so a crash never leaves a stale lock behind.
    """
    path = data_dir / "up.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConflictError(
                f"data dir {data_dir} is in use by another `llmgw up` (pid {holder}); stop it, "
                "or pass another --data-dir",
                field="--data-dir",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


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
    _write_private(path, token + "\n")
    return token


class AllInOne:
    def __init__(self, opts: UpOptions, *, say: Callable[[str], None] = print) -> None:
        self.opts = opts
        self._say = say
        self._stop = threading.Event()
        self._pg: EmbeddedPostgres | None = None
        self._child: subprocess.Popen[bytes] | None = None

    @property
    def admin_url(self) -> str:
        return _http_url(_connectable(self.opts.internal_host), self.opts.admin_port)

    @property
    def public_url(self) -> str:
        return _http_url(self.opts.host, self.opts.port)

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run(self) -> int:
        opts = self.opts
        opts.data_dir.mkdir(parents=True, exist_ok=True)
        with _data_dir_lock(opts.data_dir):
            return self._run_locked()

    def _run_locked(self) -> int:
        opts = self.opts
        if not 1 <= opts.admin_port <= 65535:
            raise ConfigError(
                f"admin port {opts.admin_port} is outside 1-65535 (it defaults to --port + 1); "
                "pass --admin-port",
                field="--admin-port",
            )
        stale = opts.data_dir / _UP_JSON
        if stale.exists():
            # We hold the lock, so whoever wrote it is gone without cleaning up.
            log.warning("previous_run_not_stopped_cleanly", up_json=str(stale))
            stale.unlink()
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
            if not _port_free(host, port, field=host_field):
                raise ConflictError(
                    f"port {port} on {host} is in use; pick another with {flag} "
                    "(or stop what holds it)",
                    field=flag,
                )
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
            from llmgw.controlplane import migrations

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
                self._start_controlplane(url, token)
            if self._wait_ready():
                self._announce(token)
                self._supervise(url, token)
        finally:
            self._stop_child()
            (opts.data_dir / _UP_JSON).unlink(missing_ok=True)
            self._pg.stop()
            self._say("Stopped.")
        return 0

    def _child_env(self, url: str, token: str) -> dict[str, str]:
        env = dict(os.environ)
        env["LLMGW_CONTROLPLANE__DATABASE_URL"] = url
        env["LLMGW_CONTROLPLANE__ADMIN_TOKEN"] = token
        env["LLMGW_LOG__LEVEL"] = self.opts.log_level
        return env

    def _start_controlplane(self, url: str, token: str) -> None:
        cmd = [
            sys.executable, "-m", "llmgw", "controlplane",
            "--public-host", self.opts.host, "--public-port", str(self.opts.port),
            "--host", self.opts.internal_host, "--port", str(self.opts.admin_port),
        ]  # fmt: skip
        if self.opts.config_path is not None:
            cmd += ["--config", str(self.opts.config_path)]
        # Own process group: a Ctrl-C in the terminal reaches us, and we stop the child in order
        # (control plane before Postgres) instead of both dying at once mid-write. Should we be
        # killed outright, the parent-death signal stops it instead of leaving it orphaned.
        self._child = subprocess.Popen(
            cmd,
            env=self._child_env(url, token),
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.info("child_started", child="controlplane", pid=self._child.pid)

    def _wait_ready(self) -> bool:
        """True once the control plane is ready; False if a stop was asked for first."""
        if self._child is None:
            return False
        deadline = time.monotonic() + _CHILD_READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stop.is_set():
            child = self._child
            if child is not None and child.poll() is not None:
                raise EngineStartError(
                    f"the control plane exited with status {child.returncode} while starting; "
                    "its log above says why"
                )
            try:
                r = httpx.get(f"{self.admin_url}/readyz", timeout=2.0)
                if r.status_code == 200:
                    return not self._stop.is_set()
            except httpx.HTTPError:
                pass
            self._stop.wait(0.1)
        if self._stop.is_set():
            return False
        raise EngineStartError(
            f"the control plane was not ready within {_CHILD_READY_TIMEOUT_S:.0f}s at "
            f"{self.admin_url}/readyz"
        )

    def _announce(self, token: str) -> None:
        assert self._pg is not None
        # The URL without its password: up.json is read by scripts and pasted into tickets; the
        # password stays in its own 0600 file, which the psql hint reads.
        app = make_url(self._pg.app_url)
        database_url = libpq_url(
            URL.create(
                app.drivername,
                username=app.username,
                host=app.host,
                port=app.port,
                database=app.database,
            ).render_as_string(hide_password=False)
        )
        info = {
            "public_url": self.public_url,
            "admin_url": self.admin_url,
            "admin_token": token,
            "database_url": database_url,
            "data_dir": str(self.opts.data_dir),
            "pid": os.getpid(),
        }
        _write_private(self.opts.data_dir / _UP_JSON, json.dumps(info, indent=2) + "\n")
        self._say(
            "\n"
            f"llmgw is up.\n"
            f"  Admin API:    {self.admin_url}/admin/v1   (OpenAPI: {self.admin_url}/docs)\n"
            f"  Admin token:  {token}\n"
            f"  Data dir:     {self.opts.data_dir}   (up.json there has both for scripts)\n"
            f"  Try:          curl -H 'Authorization: Bearer {token}' {self.admin_url}/admin/v1/models\n"
            f"  Database:     PGPASSWORD=$(cat {self._pg.app_password_path}) psql {database_url}\n"
            "Press Ctrl-C to stop.\n"
        )

    def _supervise(self, url: str, token: str) -> None:
        failures = 0
        started = time.monotonic()
        while not self._stop.wait(0.5):
            if not self._postgres_alive():
                continue
            child = self._child
            if child is None or child.poll() is None:
                continue
            # A child that stayed up a minute earns a fresh backoff; one that keeps dying waits longer.
            if time.monotonic() - started > 60:
                failures = 0
            pause = _RESTART_BACKOFF_S[min(failures, len(_RESTART_BACKOFF_S) - 1)]
            log.warning(
                "child_exited", child="controlplane", status=child.returncode, restart_in_s=pause
            )
            failures += 1
            if self._stop.wait(pause):
                break
            self._start_controlplane(url, token)
            started = time.monotonic()

    def _postgres_alive(self) -> bool:
        """Restart a Postgres that died (a crash, the OOM killer, `kill -9`) on its port.

        The control plane stays up meanwhile: /readyz says 503 and its pool, which pings each
        connection before use, reconnects by itself once the server is back. Returns whether
        Postgres runs (False only when a stop was asked for while waiting to restart it).
        """
        pg = self._pg
        assert pg is not None
        status = pg.exited()
        if status is None:
            return True
        log.warning("postgres_exited", status=status, pid_file=str(pg.pgdata / "postmaster.pid"))
        failures = 0
        while not self._stop.is_set():
            pause = _RESTART_BACKOFF_S[min(failures, len(_RESTART_BACKOFF_S) - 1)]
            log.warning("postgres_restart_scheduled", attempt=failures + 1, restart_in_s=pause)
            if self._stop.wait(pause):
                return False
            try:
                pg.restart()
            except Exception as exc:  # any failure to start is retried, longer each time
                log.warning("postgres_restart_failed", error=str(exc).splitlines()[0])
                failures += 1
                continue
            log.info("postgres_restarted", pid=pg.pid, port=pg.port, attempts=failures + 1)
            return True
        return False

    def _stop_child(self) -> None:
        child = self._child
        if child is None or child.poll() is not None:
            return
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            log.warning("child_kill", child="controlplane", pid=child.pid)
            child.kill()
            child.wait()


def _create_extensions(superuser_url: str) -> None:
    # btree_gist backs the GPU-assignment exclusion constraint (migration 0002). It is a
    # trusted extension, so the database's owner could create it too; creating it here as the
    # superuser keeps migrations working on servers where it is not (and costs nothing).
    import psycopg

    with psycopg.connect(libpq_url(superuser_url), autocommit=True, connect_timeout=10) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS btree_gist")


def _connectable(host: str) -> str:
    # A wildcard address is where one listens, not where one connects.
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
