"""The lifecycle of one embedded PostgreSQL server: initdb on first use, start, wait, stop.

Everything here is in the order `start()` runs it; initdb itself is _initdb's, the roles and
the `llmgw` database made on every start _roles'. What it must NOT do: run SQL (_roles does),
log the password, or start over a data dir whose postmaster.pid names a live process: that
lock file is PostgreSQL's own guard, and this module reads it but never removes it.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from llmgw.embedded_postgres._binaries import find_bin_dir
from llmgw.embedded_postgres._databases import create_database, drop_database
from llmgw.embedded_postgres._errors import DataDirInUseError, PostgresStartError
from llmgw.embedded_postgres._initdb import initdb
from llmgw.embedded_postgres._process import (
    HOST,
    as_owner,
    child_env,
    die_with_parent,
    free_port,
    may_enter,
    pid_in,
    port_free,
    process_name,
    read_lines,
    server_owner,
    shut_down,
    start_lock,
    tail,
)
from llmgw.embedded_postgres._roles import (
    APP_DB,
    APP_ROLE,
    SUPERUSER,
    app_password,
    ensure_app_database,
)
from llmgw.embedded_postgres._throwaway import make_throwaway_dir
from llmgw.errors import ConfigError
from llmgw.logs import get_logger

__all__ = ["EmbeddedPostgres"]

_ADMIN_DB = "postgres"
# sun_path holds 108 bytes with the NUL; a longer socket path makes postgres refuse to start.
_MAX_SOCKET_PATH = 107
_START_LOCK = "postgres.start.lock"
_LOG_MARK = "--- llmgw: starting"

_log = get_logger("llmgw.embedded_postgres")


class EmbeddedPostgres:
    """One PostgreSQL server over one data dir.

    ``throwaway=True`` trades durability for speed (fsync, synchronous_commit and
    full_page_writes off) and, with no ``data_dir``, lives in a temp dir removed by stop().
    Use as a context manager, or call start() and stop()::

        with EmbeddedPostgres(throwaway=True) as pg:
            engine = create_engine(pg.url)
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        throwaway: bool = False,
        bin_dir: str | os.PathLike[str] | None = None,
        progress: Callable[[str], None] | None = None,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 30.0,
        stop_with_owner: bool | None = None,
    ) -> None:
        if data_dir is None and not throwaway:
            raise ConfigError(
                "a persistent EmbeddedPostgres needs a data_dir (llmgw.config.default_data_dir() "
                "is the usual one); pass throwaway=True for a temp dir removed on stop",
                field="data_dir",
            )
        self._data_dir = Path(data_dir).absolute() if data_dir is not None else None
        self._owns_data_dir = data_dir is None
        self._port_wanted = port
        self._throwaway = throwaway
        # Fast shutdown when the thread that called start() dies (Linux parent-death signal).
        # Default on for throwaway servers; `llmgw up` asks for it too, starting from its main
        # thread. Off otherwise: a server started from a short-lived thread would stop with it.
        self._stop_with_owner = throwaway if stop_with_owner is None else stop_with_owner
        self._bin_dir = bin_dir
        self._progress = progress
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._port: int | None = None
        self._password: str | None = None
        self._app_password: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    # -- where things are

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise PostgresStartError(
                "the throwaway data dir exists only between start() and stop()"
            )
        return self._data_dir

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "postgres"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "postgres.log"

    @property
    def password_path(self) -> Path:
        return self.data_dir / "postgres.password"

    @property
    def app_password_path(self) -> Path:
        return self.data_dir / "postgres.app.password"

    @property
    def port(self) -> int:
        if self._port is None:
            raise PostgresStartError("the server has no port until start() returns")
        return self._port

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while this object's server runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the `llmgw` database (it carries the password: never log it)."""
        return self._url(APP_DB)

    @property
    def admin_url(self) -> str:
        """URL of the `postgres` maintenance database, for CREATE/DROP DATABASE."""
        return self._url(_ADMIN_DB)

    @property
    def app_url(self) -> str:
        """SQLAlchemy URL of the `llmgw` database as :data:`APP_ROLE` (carries its password)."""
        if self._app_password is None:
            raise PostgresStartError("the server has no URL until start() returns")
        return self._url(APP_DB, user=APP_ROLE, password=self._app_password)

    def _url(self, dbname: str, *, user: str = SUPERUSER, password: str | None = None) -> str:
        password = password if password is not None else self._password
        if password is None or self._port is None:
            raise PostgresStartError("the server has no URL until start() returns")
        pw = urllib.parse.quote(password, safe="")
        return f"postgresql+psycopg://{user}:{pw}@{HOST}:{self._port}/{dbname}"

    # -- lifecycle

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> str:
        """Initialise on first use, start, wait until ready; return :attr:`url`. Idempotent."""
        if self.pid is not None:
            return self.url
        started = time.monotonic()
        try:
            if self._port_wanted is not None and not port_free(self._port_wanted):
                raise ConfigError(
                    f"port {self._port_wanted} on {HOST} is already taken; choose another port "
                    "or leave it unset to pick a free one",
                    field="port",
                )
            owner = server_owner()
            self._prepare_data_dir(owner)
            # Two starts racing on one fresh dir would both run initdb and the loser could
            # overwrite the winner's password file; serialised, the second finds the first's
            # server in postmaster.pid and is refused like any other second start.
            with start_lock(self.data_dir / _START_LOCK):
                self._refuse_if_in_use()
                version_file = self.pgdata / "PG_VERSION"
                want = int(version_file.read_text().strip()) if version_file.is_file() else None
                bin_dir = find_bin_dir(self._bin_dir, want_major=want)
                if want is None:
                    initdb(
                        bin_dir,
                        owner,
                        data_dir=self.data_dir,
                        pgdata=self.pgdata,
                        password_path=self.password_path,
                        throwaway=self._throwaway,
                        say=self._say,
                    )
                self._password = self._read_password()
                self._spawn_until_ready(bin_dir, owner)
            self._app_password = app_password(self.app_password_path)
            ensure_app_database(self.admin_url, self.url, self._app_password)
        except BaseException:
            self._teardown()
            raise
        ready_s = round(time.monotonic() - started, 3)
        _log.info(
            "postgres_started",
            data_dir=str(self.data_dir),
            port=self._port,
            pid=self.pid,
            throwaway=self._throwaway,
            ready_s=ready_s,
        )
        self._say(f"PostgreSQL ready on {HOST}:{self._port} ({ready_s:.2f}s)")
        return self.url

    def exited(self) -> int | None:
        """The postmaster's exit status if the server this object started has died, else None."""
        return self._proc.poll() if self._proc is not None else None

    def restart(self) -> str:
        """Start again on the same port after the server died, so clients' URLs stay valid.

        After a crash (or `kill -9` of the postmaster) PostgreSQL refuses to start while
        backends of the old one still hold its shared memory; they exit within moments of
        noticing, so a caller retries with backoff on PostgresStartError.
        """
        if self.pid is not None:
            return self.url
        self._teardown_process()
        if self._port is not None:
            self._port_wanted = self._port
        return self.start()

    def stop(self) -> None:
        """Fast shutdown (SIGINT), escalating to immediate (SIGQUIT) and SIGKILL if it hangs."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            began = time.monotonic()
            how = shut_down(proc, self._stop_timeout_s)
            _log.info(
                "postgres_stopped",
                data_dir=str(self.data_dir),
                pid=proc.pid,
                how=how,
                took_s=round(time.monotonic() - began, 3),
            )
        self._teardown()

    def create_database(self, name: str, template: str | None = None) -> str:
        return create_database(self.admin_url, name, template=template)

    def drop_database(self, name: str) -> None:
        drop_database(self.admin_url, name)

    # -- steps of start()

    def _prepare_data_dir(self, owner: tuple[int, int] | None) -> None:
        if self._data_dir is None:
            self._data_dir = make_throwaway_dir()
        self._data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if owner is None:
            # It holds the password files and the server log: nobody else may list or read it
            # (a dir made by an older llmgw, or by the caller, may be 0755).
            self._data_dir.chmod(0o700)
            return
        # Under root the server runs as `postgres`, which must be able to pass through every
        # directory above its PGDATA. 0711 lets it through without letting it (or anyone) list
        # the data dir, so the 0600 password file stays private. Nothing more: no listing, no
        # reading (a dir made by an older llmgw may be 0755).
        if stat.S_IMODE(self._data_dir.stat().st_mode) != 0o711:
            self._data_dir.chmod(0o711)
        for d in self._data_dir.parents:
            st = d.stat()
            if not may_enter(st, owner):
                raise ConfigError(
                    f"the `postgres` user (uid {owner[0]}) cannot enter {d} (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}), so it cannot reach "
                    f"its data dir {self.pgdata}: choose a data dir outside {d} (e.g. under "
                    f"/var/lib) or allow passing through with `chmod o+x {d}`",
                    field="data_dir",
                )

    def _refuse_if_in_use(self) -> None:
        pidfile = self.pgdata / "postmaster.pid"
        pid = pid_in(pidfile)
        if pid is None:
            return
        comm = process_name(pid)
        if comm is None:
            # Dead: a crash left it behind. PostgreSQL replaces it itself once it sees the pid
            # is gone; deleting it here would race a server that is just starting.
            _log.info("postgres_stale_pidfile", pidfile=str(pidfile), pid=pid)
            return
        if comm in ("postgres", "postmaster", ""):
            raise DataDirInUseError(
                f"data dir {self.pgdata} is in use by a running PostgreSQL server (pid {pid}, per "
                f"{pidfile}); a second server on it would corrupt it. Stop that one first (the "
                f"`llmgw up` that started it, or `kill -INT {pid}`), or use another data dir",
                pid=pid,
            )
        raise DataDirInUseError(
            f"{pidfile} names pid {pid}, which is alive but is {comm!r}, not postgres: most likely "
            "the file is left from a crash and the pid was reused. PostgreSQL refuses to start "
            f"while it is there; if no server uses {self.pgdata}, delete {pidfile} and start again",
            pid=pid,
        )

    def _read_password(self) -> str:
        try:
            return self.password_path.read_text().strip()
        except FileNotFoundError:
            raise ConfigError(
                f"{self.password_path} is missing, so llmgw cannot log in to the server in "
                f"{self.pgdata}: restore the file, or move {self.data_dir} aside to start afresh",
                field="data_dir",
            ) from None

    def _spawn_until_ready(self, bin_dir: Path, owner: tuple[int, int] | None) -> None:
        # A free port found by binding 0 can be taken before postgres binds it; retry on that.
        for attempt in range(1 if self._port_wanted is not None else 3):
            self._port = self._port_wanted or free_port()
            try:
                self._spawn(bin_dir, owner)
                self._wait_ready()
                return
            except _PortTakenError:
                self._teardown_process()
                if attempt == 2 or self._port_wanted is not None:
                    raise PostgresStartError(
                        f"port {self._port} was taken before PostgreSQL could bind it; retry"
                    ) from None

    def _spawn(self, bin_dir: Path, owner: tuple[int, int] | None) -> None:
        assert self._port is not None
        socket_dir = str(self.pgdata)
        if len(f"{socket_dir}/.s.PGSQL.{self._port}") > _MAX_SOCKET_PATH:
            # Too long for a unix socket; TCP with the password still works.
            _log.warning("postgres_socket_disabled", data_dir=str(self.data_dir))
            socket_dir = ""
        settings = {
            "listen_addresses": HOST,
            "unix_socket_directories": socket_dir,
            "unix_socket_permissions": "0700",
            "max_connections": "200",
            # Never write statement text or bind parameters to the log: an admin write that
            # fails (a CHECK, a bad JSON value) would otherwise copy its values, secret_env
            # included, into postgres.log. terse also drops DETAIL ("Failing row contains
            # ...") and CONTEXT ("JSON data, line 1: ..."), which quote the values themselves.
            "log_min_error_statement": "panic",
            "log_statement": "none",
            "log_parameter_max_length": "0",
            "log_parameter_max_length_on_error": "0",
            "log_error_verbosity": "terse",
        }
        if self._throwaway:
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        args = [str(bin_dir / "postgres"), "-D", str(self.pgdata), "-p", str(self._port)]
        for key, value in settings.items():
            args += ["-c", f"{key}={value}"]
        # 0600: even terse, the log names roles, databases and constraint names.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)  # a log from an older llmgw may be 0644
        self._log_file = os.fdopen(fd, "ab")
        self._log_file.write(f"{_LOG_MARK} postgres on port {self._port}\n".encode())
        self._log_file.flush()
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.pgdata,
            env=child_env(),
            # Its own session: a Ctrl-C at the terminal goes to `llmgw up`, which stops the
            # control plane first and the database last, instead of the database dying first.
            start_new_session=True,
            # The server must not outlive its owner: a test run or `llmgw up` killed with
            # SIGKILL (or a closed terminal) still gets a fast, clean shutdown (SIGINT).
            preexec_fn=die_with_parent if self._stop_with_owner else None,
            **as_owner(owner),
        )

    def _wait_ready(self) -> None:
        assert self._proc is not None
        pidfile = self.pgdata / "postmaster.pid"
        deadline = time.monotonic() + self._start_timeout_s
        pause = 0.002
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self._raise_start_failure(rc)
            # Line 8 of postmaster.pid is the server's own status; "ready" is written after the
            # listen sockets exist and recovery is done, exactly what pg_ctl waits for.
            lines = read_lines(pidfile)
            if len(lines) >= 8 and lines[0] == str(self._proc.pid) and lines[7].strip() == "ready":
                return
            if time.monotonic() > deadline:
                raise PostgresStartError(
                    f"PostgreSQL on {self.pgdata} was not ready after {self._start_timeout_s:.0f}s "
                    f"(crash recovery of a large data dir can take longer); its log "
                    f"{self.log_path} ends with:\n{tail(self._log_text())}"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _raise_start_failure(self, rc: int) -> None:
        # Only this start's part of the log: earlier runs' lines say nothing about this one.
        log = self._log_text().rsplit(_LOG_MARK, 1)[-1]
        if "could not bind" in log:
            raise _PortTakenError()
        pid = pid_in(self.pgdata / "postmaster.pid")
        if pid is not None and "lock file" in log and process_name(pid) is not None:
            # Lost a race with another start on the same data dir; postgres's lock held.
            self._refuse_if_in_use()
        raise PostgresStartError(
            f"PostgreSQL exited with status {rc} while starting on {self.pgdata}; its log "
            f"{self.log_path} ends with:\n{tail(log)}"
        )

    # -- helpers

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)

    def _log_text(self) -> str:
        try:
            return self.log_path.read_bytes()[-20000:].decode(errors="replace")
        except OSError:
            return ""

    def _teardown_process(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            shut_down(self._proc, self._stop_timeout_s)
        self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _teardown(self) -> None:
        self._teardown_process()
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
            self._port = None
            self._password = None


class _PortTakenError(Exception):
    pass
