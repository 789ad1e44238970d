"""The embedded Postgres server and the database fixtures, against real postgres processes.

Runs as root here, so every server below runs as the `postgres` user out of dirs it can enter.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from structlog.testing import capture_logs

from llmgw.embedded_postgres import (
    DataDirInUseError,
    EmbeddedPostgres,
    PostgresStartError,
    find_bin_dir,
    libpq_url,
    throwaway_parent,
)
from llmgw.errors import ConfigError
from tests.support.waiting import wait_for

# The acceptance target is 3 s; initdb dominates (about 1 s alone on an idle 2-core box).
READY_BOUND_S = 3.0


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    def gone() -> bool:
        try:
            return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()  # a zombie is gone
        except FileNotFoundError:
            return True

    wait_for(gone, timeout_s=timeout_s, what=f"pid {pid} to exit", interval_s=0.01)


def _throwaway_dirs() -> set[Path]:
    return {
        p for root in ("/dev/shm", tempfile.gettempdir()) for p in Path(root).glob("llmgw-pg-*")
    }


def _query(url: str, query: str) -> list[tuple[object, ...]]:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        cur = conn.execute(query)
        return cur.fetchall() if cur.description is not None else []


def test_throwaway_ready_fast_then_stops_and_cleans_up() -> None:
    began = time.monotonic()
    pg = EmbeddedPostgres(throwaway=True)
    with capture_logs() as logs:
        url = pg.start()
    ready_s = time.monotonic() - began
    print(f"throwaway postgres ready in {ready_s:.3f}s (initdb included)")
    try:
        pid, data_dir = pg.pid, pg.data_dir
        assert pid is not None
        assert _query(url, "SELECT current_user, current_database()") == [("llmgw", "llmgw")]
        assert _query(url, "SHOW fsync") == [("off",)]
        assert _query(url, "SHOW listen_addresses") == [("127.0.0.1",)]
        if os.geteuid() == 0:
            assert pg.pgdata.stat().st_uid != 0, "the server's files must belong to `postgres`"
        started = [e for e in logs if e["event"] == "postgres_started"]
        assert len(started) == 1 and started[0]["port"] == pg.port
        password = pg.password_path.read_text().strip()
        assert not any(password in repr(e) for e in logs), "the password must never be logged"
    finally:
        pg.stop()
    _wait_gone(pid)
    assert not data_dir.exists()
    assert ready_s < READY_BOUND_S


def test_tcp_login_needs_the_generated_password(pg_tmp_path: Path) -> None:
    with EmbeddedPostgres(pg_tmp_path / "data", throwaway=True) as pg:
        assert stat.S_IMODE(pg.password_path.stat().st_mode) == 0o600
        password = pg.password_path.read_text().strip()
        assert len(password) >= 24 and password in pg.url
        for wrong in (f"llmgw:nope@127.0.0.1:{pg.port}", f"llmgw@127.0.0.1:{pg.port}"):
            with pytest.raises(psycopg.OperationalError, match="password"):
                psycopg.connect(f"postgresql://{wrong}/llmgw", connect_timeout=5).close()


def test_restart_reuses_data_without_initdb(pg_tmp_path: Path) -> None:
    data_dir = pg_tmp_path / "llmgw"
    with EmbeddedPostgres(data_dir) as pg:
        _query(pg.url, "CREATE TABLE kept (v text); INSERT INTO kept VALUES ('survives')")
        assert _query(pg.url, "SHOW fsync") == [("on",)], "persistent mode must stay durable"
        first_port = pg.port
    with capture_logs() as logs, EmbeddedPostgres(data_dir, port=None) as pg:
        assert _query(pg.url, "SELECT v FROM kept") == [("survives",)]
        print(f"ports: first {first_port}, second {pg.port}")
    events = [e["event"] for e in logs]
    assert "postgres_initdb" not in events and "postgres_started" in events


def test_second_server_on_a_data_dir_in_use_is_refused_with_the_pid(pg_tmp_path: Path) -> None:
    data_dir = pg_tmp_path / "llmgw"
    with EmbeddedPostgres(data_dir) as first:
        second = EmbeddedPostgres(data_dir)
        with pytest.raises(DataDirInUseError) as caught:
            second.start()
        assert caught.value.pid == first.pid
        assert f"pid {first.pid}" in str(caught.value)
        assert second.pid is None
        # The running server is untouched and its lock file still in place.
        assert _query(first.url, "SELECT 1") == [(1,)]
        assert (first.pgdata / "postmaster.pid").read_text().split()[0] == str(first.pid)


def test_two_racing_first_starts_on_one_dir_yield_one_server(pg_tmp_path: Path) -> None:
    data_dir = pg_tmp_path / "llmgw"
    servers = [EmbeddedPostgres(data_dir), EmbeddedPostgres(data_dir)]
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(_start_or_error, servers))
    try:
        urls = [o for o in outcomes if isinstance(o, str)]
        refused = [o for o in outcomes if isinstance(o, DataDirInUseError)]
        assert len(urls) == 1 and len(refused) == 1, outcomes
        # The winner's password file was not overwritten by the loser's initdb.
        assert _query(urls[0], "SELECT 1") == [(1,)]
    finally:
        for pg in servers:
            pg.stop()


def _start_or_error(pg: EmbeddedPostgres) -> str | Exception:
    try:
        return pg.start()
    except Exception as exc:
        return exc


@pytest.mark.e2e
def test_stale_pidfile_from_a_crash_is_tolerated_and_a_reused_pid_refused(
    pg_tmp_path: Path,
) -> None:
    data_dir = pg_tmp_path / "llmgw"
    with EmbeddedPostgres(data_dir) as pg:
        pidfile = pg.pgdata / "postmaster.pid"
        lines = pidfile.read_text().splitlines()
        owner = pidfile.stat()
    # A pid that is certainly dead: a child we started and reaped.
    dead = subprocess.Popen(["true"])
    dead.wait()
    pidfile.write_text("\n".join([str(dead.pid), *lines[1:]]) + "\n")
    os.chown(pidfile, owner.st_uid, owner.st_gid)
    with EmbeddedPostgres(data_dir) as pg:
        assert _query(pg.url, "SELECT 1") == [(1,)]
    # A live pid that is not postgres (this test's own): the pid was reused after a crash.
    # Refused, naming the pid, and nothing is deleted.
    pidfile.write_text("\n".join([str(os.getpid()), *lines[1:]]) + "\n")
    with pytest.raises(DataDirInUseError, match=f"pid {os.getpid()}, which is alive but is"):
        EmbeddedPostgres(data_dir).start()
    assert pidfile.exists()


def test_a_server_that_fails_to_start_is_reported_with_its_log(pg_tmp_path: Path) -> None:
    data_dir = pg_tmp_path / "llmgw"
    with EmbeddedPostgres(data_dir) as pg:
        conf = pg.pgdata / "postgresql.conf"
    with conf.open("a") as f:
        f.write("shared_buffers = 'lots'\n")
    broken = EmbeddedPostgres(data_dir)
    with pytest.raises(PostgresStartError, match="exited with status") as caught:
        broken.start()
    assert "shared_buffers" in str(caught.value) and str(broken.log_path) in str(caught.value)
    assert broken.pid is None


def test_taken_port_is_a_config_error(pg_tmp_path: Path) -> None:
    with EmbeddedPostgres(throwaway=True) as pg:
        other = EmbeddedPostgres(pg_tmp_path / "other", port=pg.port, throwaway=True)
        with pytest.raises(ConfigError, match=f"port {pg.port}") as caught:
            other.start()
        assert caught.value.field == "port"


@pytest.mark.e2e
def test_dirs_left_by_a_killed_run_are_swept_and_live_ones_kept() -> None:
    parent = Path(throwaway_parent() or tempfile.gettempdir())
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix="llmgw-pg-", dir=parent))
    (stale / "owner.pid").write_text(f"{dead.pid}\n")
    live = Path(tempfile.mkdtemp(prefix="llmgw-pg-", dir=parent))
    (live / "owner.pid").write_text(f"{os.getpid()}\n")
    try:
        with EmbeddedPostgres(throwaway=True) as pg:
            assert pg.data_dir.parent == parent
        assert not stale.exists()
        assert live.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_no_binaries_error_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        find_bin_dir(path="", system_globs=(), use_pgserver=False)
    message = str(caught.value)
    assert "apt-get install postgresql" in message and "pip install pgserver" in message
    # An explicit bin dir without the binaries fails the same way, naming it; no temp dir leaks.
    before = _throwaway_dirs()
    with pytest.raises(ConfigError, match=str(tmp_path)) as caught:
        EmbeddedPostgres(throwaway=True, bin_dir=tmp_path).start()
    assert "apt-get install postgresql" in str(caught.value)
    assert _throwaway_dirs() <= before


def test_data_dir_of_another_major_version_is_refused(pg_tmp_path: Path) -> None:
    pgdata = pg_tmp_path / "llmgw" / "postgres"
    pgdata.mkdir(parents=True)
    (pgdata / "PG_VERSION").write_text("9\n")
    with pytest.raises(ConfigError, match="created by PostgreSQL 9 but") as caught:
        EmbeddedPostgres(pgdata.parent).start()
    assert "apt-get install postgresql-9" in str(caught.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to `postgres`")
def test_root_refuses_a_data_dir_postgres_cannot_reach(pg_tmp_path: Path) -> None:
    locked = pg_tmp_path / "locked"
    locked.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=f"cannot enter {locked}") as caught:
        EmbeddedPostgres(locked / "llmgw").start()
    assert "chmod o+x" in str(caught.value)


def test_empty_db_url_is_a_fresh_empty_database(empty_db_url: str, pg_server: object) -> None:
    tables = _query(
        empty_db_url,
        "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')",
    )
    assert tables == [(0,)]
    _query(empty_db_url, "CREATE TABLE scratch (x int)")


def test_empty_db_url_does_not_see_the_previous_tests_tables(empty_db_url: str) -> None:
    assert _query(empty_db_url, "SELECT to_regclass('scratch') IS NULL") == [(True,)]


def test_db_url_is_migrated_to_head_and_isolated(db_url: str) -> None:
    from llmgw.store.migrations import current_revision, head_revision

    assert current_revision(db_url) == head_revision()
    _query(db_url, "CREATE TABLE scratch (x int)")


def test_db_url_gets_a_new_clone_each_test(db_url: str) -> None:
    assert _query(db_url, "SELECT to_regclass('scratch') IS NULL") == [(True,)]


def test_failed_statements_leave_no_values_in_the_server_log_and_its_files_are_private(
    pg_tmp_path: Path,
) -> None:
    data_dir = pg_tmp_path / "data"
    data_dir.mkdir()
    data_dir.chmod(0o755)  # as an older llmgw (or a plain mkdir) left it
    secret = "sk-planted-" + os.urandom(8).hex()
    pg = EmbeddedPostgres(data_dir)
    pg.start()
    try:
        with psycopg.connect(libpq_url(pg.url), autocommit=True) as conn:
            conn.execute("CREATE TABLE t (v text CONSTRAINT v_short CHECK (length(v) < 8))")
            # The failing row (DETAIL), the bind parameters, and the JSON text quoted in a
            # CONTEXT line (the lone surrogate of the hardening issue) would each carry it.
            for statement, params in (
                ("INSERT INTO t VALUES (%s)", (secret,)),
                ("SELECT %s::jsonb", ('{"k": "' + secret + '\\ud800"}',)),
                ("SELECT %s::text::varchar(4)::int", (secret,)),
            ):
                with pytest.raises(psycopg.Error):
                    conn.execute(statement, params)
        # Another session's work forces the log lines out before we read them.
        with psycopg.connect(libpq_url(pg.url), autocommit=True) as conn:
            conn.execute("SELECT 1")
    finally:
        pg.stop()
    log = pg.log_path.read_text()
    assert 'violates check constraint "v_short"' in log, log[-2000:]  # errors are still logged
    assert secret not in log, log[-2000:]
    # Private: group and others may at most pass through (as root, the `postgres` user must).
    want_dir = 0o711 if os.geteuid() == 0 else 0o700
    assert stat.S_IMODE(data_dir.stat().st_mode) == want_dir
    assert stat.S_IMODE(pg.log_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(pg.app_password_path.stat().st_mode) == 0o600


def test_the_app_role_owns_its_database_and_is_no_superuser(pg_tmp_path: Path) -> None:
    data_dir = pg_tmp_path / "data"
    with EmbeddedPostgres(data_dir) as pg:
        with psycopg.connect(libpq_url(pg.app_url), autocommit=True) as conn:
            conn.execute("CREATE TABLE mine (x int)")
            row = conn.execute(
                "SELECT current_user, rolsuper, rolcreaterole, rolcreatedb, "
                "pg_get_userbyid((SELECT datdba FROM pg_database WHERE datname = current_database())) "
                "FROM pg_roles WHERE rolname = current_user"
            ).fetchone()
            assert row == ("llmgw_app", False, False, False, "llmgw_app")
            # What only a superuser may do is refused: reading the server's files.
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("COPY mine FROM '/etc/hostname'")
        # A database an older llmgw made as the superuser is handed over on the next start.
        with psycopg.connect(libpq_url(pg.url), autocommit=True) as conn:
            conn.execute("CREATE TABLE legacy (id serial PRIMARY KEY)")
            conn.execute("ALTER DATABASE llmgw OWNER TO llmgw")
    with (
        EmbeddedPostgres(data_dir) as pg,
        psycopg.connect(libpq_url(pg.app_url), autocommit=True) as conn,
    ):
        conn.execute("ALTER TABLE legacy ADD COLUMN y int")
        conn.execute("INSERT INTO legacy (y) VALUES (1)")
