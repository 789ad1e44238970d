"""initdb on a data dir's first start: the cluster is made in a staging dir and renamed into
place only when whole, with the superuser's generated password in a 0600 file.

What it must NOT do: write over a PGDATA that exists (a non-empty one without PG_VERSION is
refused), or pass the password on a command line or through a pipe.
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.embedded_postgres._errors import PostgresStartError
from llmgw.embedded_postgres._process import chown, run_as, tail, write_private
from llmgw.embedded_postgres._roles import SUPERUSER
from llmgw.errors import ConfigError
from llmgw.logs import get_logger

__all__ = ["initdb"]

_log = get_logger("llmgw.embedded_postgres")


def initdb(
    bin_dir: Path,
    owner: tuple[int, int] | None,
    *,
    data_dir: Path,
    pgdata: Path,
    password_path: Path,
    throwaway: bool,
    say: Callable[[str], None],
) -> None:
    """Make ``pgdata`` with ``bin_dir``'s initdb, as ``owner`` (uid, gid; None: this user);
    ``throwaway`` skips syncing it to disk."""
    began = time.monotonic()
    _log.info("postgres_initdb", data_dir=str(data_dir), bin_dir=str(bin_dir))
    say(f"initialising PostgreSQL in {pgdata} (first run)")
    if pgdata.exists() and any(pgdata.iterdir()):
        raise ConfigError(
            f"{pgdata} is not empty but holds no PG_VERSION, so it is no PostgreSQL data "
            "dir llmgw made; move it aside or choose another data dir",
            field="data_dir",
        )
    # initdb writes into a staging dir renamed into place only when complete: an initdb
    # killed halfway leaves something we delete and redo, never a half-made PGDATA that
    # later starts as if it were whole.
    stage = data_dir / "postgres.initdb"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(mode=0o700)
    chown(stage, owner)
    password = secrets.token_urlsafe(24)
    # initdb runs as `postgres` and cannot read a root-owned pipe, so the password goes
    # through a 0600 file in the private staging dir.
    pwfile = stage / "pwfile"
    write_private(pwfile, password + "\n", owner)
    args = [
        str(bin_dir / "initdb"),
        "--pgdata",
        str(stage / "data"),
        "--username",
        SUPERUSER,
        "--pwfile",
        str(pwfile),
        "--encoding",
        "UTF8",
        # C collation: byte order, identical on every host, and no dependency on which
        # locales the machine has generated.
        "--no-locale",
        # The socket lives in PGDATA (0700, unix_socket_permissions 0700): only the server's
        # own OS user and root can reach it, so trust there is no wider than file access.
        # TCP, which every local user can reach, needs the password.
        "--auth-local=trust",
        "--auth-host=scram-sha-256",
    ]
    if throwaway:
        args.append("--no-sync")
    done = run_as(args, owner, cwd=stage)
    if done.returncode != 0:
        raise PostgresStartError(
            f"initdb of {pgdata} failed with status {done.returncode}:\n"
            f"{tail(done.stdout.decode(errors='replace'))}"
        )
    pwfile.unlink()
    write_private(password_path, password + "\n", None)
    (stage / "data").rename(pgdata)
    shutil.rmtree(stage, ignore_errors=True)
    _log.info(
        "postgres_initialized",
        data_dir=str(data_dir),
        took_s=round(time.monotonic() - began, 3),
    )
