"""The built wheel, installed where no checkout is, migrates a database and runs the control plane.

Offline and fast: the wheel is built without build isolation (the dev venv has setuptools), and
the fresh venv gets its third-party dependencies from the dev venv's site-packages through a
.pth file, while llmgw itself comes only from the wheel (asserted: the module's file is in the
fresh venv, and every command runs from a directory outside the checkout).
"""

from __future__ import annotations

import os
import secrets
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from llmgw.store import migrations
from tests.support.procs import free_port, stop_process, wait_http_ok

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.packaging, pytest.mark.timeout(120)]

# What a build reads; copied out so the build writes its build/ and egg-info nowhere near the
# checkout other work shares.
_SOURCES = ("pyproject.toml", "setup.py", "README.md", "llmgw", "alembic", "config")


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=90, check=False
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _build_wheel(work: Path) -> Path:
    src = work / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in _SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = work / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(src)],
        cwd=work,
    )  # fmt: skip
    (wheel,) = out.glob("llmgw-*.whl")
    return wheel


def _fresh_venv(work: Path, wheel: Path) -> Path:
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work)
    python = venv / "bin" / "python"
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=work,
        ).strip()
    )
    _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(purelib), str(wheel)],
        cwd=work,
    )  # fmt: skip
    # Dependencies only: a directory named in a .pth is appended to sys.path after the venv's
    # own site-packages (so the wheel's llmgw wins), and the .pth files inside it, among them
    # the editable install's finder that would import the checkout, are not processed.
    deps = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    (purelib / "llmgw_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return python


def test_the_wheel_alone_migrates_and_serves(pg_server: object, empty_db_url: str) -> None:
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"llmgw-wheel-{secrets.token_hex(4)}"
    work.mkdir()
    try:
        wheel = _build_wheel(work)
        python = _fresh_venv(work, wheel)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LLMGW_"))}
        env["LLMGW_CONTROLPLANE__DATABASE_URL"] = empty_db_url

        where = _run(
            [str(python), "-c", "import llmgw, llmgw.store.migrations as m; "
             "from llmgw.up.bootstrap import demo_file; "
             "print(llmgw.__file__); print(m.script_location()); print(demo_file())"],
            cwd=work, env=env,
        ).split()  # fmt: skip
        # `llmgw up`'s demo ships too: an installed llmgw brings it up without a checkout.
        assert where[-1].endswith("_config/demo.yaml") and Path(where[-1]).is_file(), where
        assert all(str(ROOT) not in p and p.startswith(str(work / "venv")) for p in where), where

        _run([str(python), "-m", "llmgw", "db", "upgrade"], cwd=work, env=env)
        assert migrations.current_revision(empty_db_url) == migrations.head_revision()

        port, public_port = free_port(), free_port()
        env["LLMGW_CONTROLPLANE__ADMIN_TOKEN"] = secrets.token_urlsafe(24)
        log = work / "controlplane.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(python), "-m", "llmgw", "controlplane", "--port", str(port),
                 "--public-port", str(public_port)],
                cwd=work, env=env, stdout=out, stderr=out,
            )  # fmt: skip
        try:
            wait_http_ok(f"http://127.0.0.1:{port}/readyz", timeout_s=30, proc=proc, log=log)
            # The console's templates and vendored scripts ship in the wheel too.
            sign_in = httpx.get(f"http://127.0.0.1:{port}/ui/", timeout=10)
            assert sign_in.status_code == 200 and "Admin token" in sign_in.text, sign_in.text
            htmx = httpx.get(f"http://127.0.0.1:{port}/ui/static/vendor/htmx-2.0.4.min.js")
            assert htmx.status_code == 200 and len(htmx.content) > 40_000
        finally:
            stop_process(proc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
