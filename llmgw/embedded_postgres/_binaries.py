"""Finding PostgreSQL server binaries: an explicit dir, PATH, system layouts, the pgserver wheel.

It only looks and asks `postgres -V`; it never starts a server, and it imports pgserver not at all
(find_spec locates the wheel's files without running its import-time code).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

from llmgw.errors import ConfigError

__all__ = ["INSTALL_HINT", "MIN_MAJOR", "SYSTEM_BIN_GLOBS", "find_bin_dir"]

MIN_MAJOR = 13

# Newest version first within each pattern; Debian/Ubuntu, then RHEL's PGDG layout.
SYSTEM_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin")
INSTALL_HINT = (
    "install them with `apt-get install postgresql` (Debian/Ubuntu; the system service need "
    "not run, llmgw starts its own server), `dnf install postgresql-server` (Fedora/RHEL) or "
    "`pip install pgserver` (a wheel that bundles the binaries), or pass the directory that "
    "holds `postgres` and `initdb` as bin_dir"
)


def find_bin_dir(
    bin_dir: str | os.PathLike[str] | None = None,
    *,
    want_major: int | None = None,
    path: str | None = None,
    system_globs: tuple[str, ...] = SYSTEM_BIN_GLOBS,
    use_pgserver: bool = True,
) -> Path:
    """The directory holding `postgres` and `initdb`.

    Search order: ``bin_dir`` (only it, when given), ``path`` (default ``$PATH``), the system
    layouts newest first, then the `pgserver` wheel; the first of version MIN_MAJOR or newer wins.
    ``want_major`` (an existing data dir's PG_VERSION) picks the first candidate of exactly that
    major version instead: data files only open with it.
    """
    if bin_dir is not None:
        candidates = [Path(bin_dir)]
        if not _has_server(candidates[0]):
            raise ConfigError(
                f"bin_dir {candidates[0]} holds no executable `postgres` and `initdb`: "
                f"{INSTALL_HINT}",
                field="bin_dir",
            )
    else:
        candidates = list(_candidate_dirs(path, system_globs, use_pgserver))
    if not candidates:
        raise ConfigError(
            "no PostgreSQL server binaries (`postgres` and `initdb`) found on PATH, in "
            f"{', '.join(system_globs) or 'no system dirs'} or in the pgserver package: "
            f"{INSTALL_HINT}",
            field="bin_dir",
        )
    found: list[str] = []
    for cand in candidates:
        major = _major_version(cand)
        if major == want_major or (want_major is None and major >= MIN_MAJOR):
            return cand
        found.append(f"{major} in {cand}")
    if want_major is None:
        raise ConfigError(
            f"llmgw needs PostgreSQL {MIN_MAJOR} or newer (it relies on DROP DATABASE ... WITH "
            f"(FORCE)) but found only {'; '.join(found)}: {INSTALL_HINT}",
            field="bin_dir",
        )
    raise ConfigError(
        f"the data dir was created by PostgreSQL {want_major} but the server binaries found are "
        f"{'; '.join(found)}: data files open only with their own major version. Install "
        f"PostgreSQL {want_major} (e.g. `apt-get install postgresql-{want_major}`) and pass its bin "
        "dir, or move the old data dir aside (or pg_upgrade it) to start afresh",
        field="bin_dir",
    )


def _candidate_dirs(
    path: str | None, system_globs: tuple[str, ...], use_pgserver: bool
) -> Iterator[Path]:
    seen: set[Path] = set()

    def fresh(d: Path) -> bool:
        key = d.resolve()
        if key in seen or not _has_server(d):
            return False
        seen.add(key)
        return True

    search = os.environ.get("PATH", "") if path is None else path
    for entry in search.split(os.pathsep):
        if entry and fresh(Path(entry)):
            yield Path(entry)
    for pattern in system_globs:
        for hit in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            if fresh(Path(hit)):
                yield Path(hit)
    if use_pgserver:
        pg_wheel = _pgserver_bin_dir()
        if pg_wheel is not None and fresh(pg_wheel):
            yield pg_wheel


def _version_key(p: str) -> tuple[int, ...]:
    # Numeric, so /usr/lib/postgresql/9.6 sorts below .../15.
    return tuple(int(n) for n in re.findall(r"\d+", p))


def _pgserver_bin_dir() -> Path | None:
    # find_spec locates the package without importing it: pgserver's import has side effects
    # (it sets up its own server machinery) that we want none of.
    try:
        spec = importlib.util.find_spec("pgserver")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        cand = Path(loc) / "pginstall" / "bin"
        if cand.is_dir():
            return cand
    return None


def _has_server(d: Path) -> bool:
    return all(
        os.access(d / exe, os.X_OK) and (d / exe).is_file() for exe in ("postgres", "initdb")
    )


@functools.lru_cache(maxsize=16)
def _major_version(bin_dir: Path) -> int:
    out = subprocess.run(
        [str(bin_dir / "postgres"), "-V"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    m = re.search(r"\(PostgreSQL\)\s+(\d+)", out)
    if m is None:
        raise ConfigError(
            f"{bin_dir / 'postgres'} -V printed {out.strip()!r}, not a PostgreSQL version",
            field="bin_dir",
        )
    return int(m.group(1))
