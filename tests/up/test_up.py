"""`llmgw up --no-demo` end to end: embedded Postgres, migrations, the control plane and the
agent as real processes (tests/up covers the demo, the printed examples and engines)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.support.procs import free_port, llmgw_cmd, stop_process
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _up_args(data_dir: Path, port: int, admin_port: int, *extra: str) -> list[str]:
    return llmgw_cmd(
        "up",
        "--data-dir",
        str(data_dir),
        "--port",
        str(port),
        "--admin-port",
        str(admin_port),
        "--no-demo",
        *extra,
    )


def _start(
    data_dir: Path, port: int, admin_port: int, log: Path, *extra: str
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            _up_args(data_dir, port, admin_port, *extra),
            stdout=out,
            stderr=out,
            start_new_session=True,
            env=dict(os.environ, LLMGW_LOG__JSON="true"),
        )


def _up_json(data_dir: Path, proc: subprocess.Popen[bytes], log: Path) -> dict[str, str]:
    def read() -> dict[str, str] | None:
        if proc.poll() is not None:
            raise AssertionError(
                f"llmgw up exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        path = data_dir / "up.json"
        if not path.exists():
            return None
        info = json.loads(path.read_text())
        # A run killed outright leaves its up.json behind: only this process's counts.
        return info if info.get("pid") == proc.pid else None

    return wait_for(read, timeout_s=90, what="up.json", interval_s=0.1)


def test_up_serves_keeps_data_across_restarts_and_refuses_a_second_run(pg_tmp_path: Path) -> None:
    data_dir = pg_tmp_path / "data"
    log = pg_tmp_path / "up.log"
    port, admin_port = free_port(), free_port()
    proc = _start(data_dir, port, admin_port, log)
    try:
        info = _up_json(data_dir, proc, log)
        assert (data_dir / "up.json").stat().st_mode & 0o077 == 0
        headers = {"Authorization": f"Bearer {info['admin_token']}"}
        r = httpx.post(
            f"{info['admin_url']}/admin/v1/models", json={"name": "kept"}, headers=headers
        )
        assert r.status_code == 201, r.text

        # A second `llmgw up` on the same data dir is refused and harms nothing.
        second = subprocess.run(
            _up_args(data_dir, free_port(), free_port()),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2, second.stderr
        assert (
            "data dir" in second.stderr and "in use" in second.stderr.lower()
        ) or "uses" in second.stderr
        assert (
            httpx.get(f"{info['admin_url']}/admin/v1/models/kept", headers=headers).status_code
            == 200
        )
    finally:
        status = stop_process(proc, sig=signal.SIGINT, timeout_s=60)
    assert status == 0, log.read_text()[-3000:]
    assert not (data_dir / "up.json").exists()

    proc = _start(data_dir, port, admin_port, log)
    try:
        again = _up_json(data_dir, proc, log)
        assert again["admin_token"] == info["admin_token"]
        r = httpx.get(
            f"{again['admin_url']}/admin/v1/models/kept",
            headers={"Authorization": f"Bearer {again['admin_token']}"},
        )
        assert r.status_code == 200 and r.json()["name"] == "kept"
    finally:
        assert stop_process(proc, sig=signal.SIGINT, timeout_s=60) == 0


def _pids_with(needle: str) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if needle in cmdline:
                pids.add(int(entry.name))
    return pids


def test_killed_up_leaves_no_orphans_and_the_next_run_works(pg_tmp_path: Path) -> None:
    data_dir = pg_tmp_path / "data"
    log = pg_tmp_path / "up.log"
    port, admin_port = free_port(), free_port()
    proc = _start(data_dir, port, admin_port, log)
    try:
        info = _up_json(data_dir, proc, log)
        headers = {"Authorization": f"Bearer {info['admin_token']}"}
        assert (
            httpx.post(
                f"{info['admin_url']}/admin/v1/models", json={"name": "survivor"}, headers=headers
            ).status_code
            == 201
        )
        # The postmaster (and its workers), the control plane and the agent.
        children = _pids_with(str(data_dir)) | _pids_with(f"--port {admin_port}")
        children.discard(proc.pid)
        assert len(children) >= 3, children
    finally:
        proc.kill()  # no chance to clean up: SIGKILL
        proc.wait()
    wait_for(
        lambda: not (_pids_with(str(data_dir)) | _pids_with(f"--port {admin_port}")),
        timeout_s=30,
        what="Postgres, the control plane and the agent to stop after their supervisor was killed",
    )
    proc = _start(data_dir, port, admin_port, log)
    try:
        again = _up_json(data_dir, proc, log)
        r = httpx.get(
            f"{again['admin_url']}/admin/v1/models/survivor",
            headers={"Authorization": f"Bearer {again['admin_token']}"},
        )
        assert r.status_code == 200
    finally:
        assert stop_process(proc, sig=signal.SIGINT, timeout_s=60) == 0


def _non_loopback_ipv4() -> str | None:
    # Connecting a UDP socket sends nothing; it only asks the kernel which source address a
    # packet to a documentation address would leave from: the machine's outward address.
    candidates = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            candidates.append(s.getsockname()[0])
    except OSError:
        pass
    with contextlib.suppress(OSError):
        candidates += subprocess.run(
            ["hostname", "-I"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.split()
    for ip in candidates:
        if "." in ip and not ip.startswith("127."):
            return str(ip)
    return None


def _connects(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=3):
            return True
    except ConnectionRefusedError:
        return False


def test_up_on_all_interfaces_exposes_only_the_public_listener(pg_tmp_path: Path) -> None:
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect to")
    data_dir = pg_tmp_path / "data"
    log = pg_tmp_path / "up.log"
    port, admin_port = free_port(), free_port()
    proc = _start(data_dir, port, admin_port, log, "--host", "0.0.0.0")
    try:
        info = _up_json(data_dir, proc, log)
        # The OpenAI listener answers on the outward address; the admin API does not listen
        # there at all (refused, not 401), only on loopback.
        assert _connects(ip, port)
        assert httpx.get(f"http://{ip}:{port}/v1/models", timeout=5).status_code < 500
        assert not _connects(ip, admin_port), f"the admin port {admin_port} answers on {ip}"
        assert info["admin_url"] == f"http://127.0.0.1:{admin_port}"
        assert httpx.get(f"{info['admin_url']}/readyz", timeout=5).status_code == 200

        # The control plane's database role: recorded without its password, no superuser,
        # owner of what the migrations made.
        url = make_url(info["database_url"])
        assert url.password is None and url.username == "llmgw_app", info["database_url"]
        password = (data_dir / "postgres.app.password").read_text().strip()
        for text in ((data_dir / "up.json").read_text(), log.read_text()):
            assert password not in text
        assert "psql postgresql://llmgw_app@127.0.0.1:" in log.read_text()
        with psycopg.connect(info["database_url"], password=password) as conn:
            row = conn.execute(
                "SELECT rolsuper, (SELECT tableowner FROM pg_tables WHERE tablename = 'models') "
                "FROM pg_roles WHERE rolname = current_user"
            ).fetchone()
        assert row == (False, "llmgw_app")
        assert stat.S_IMODE((data_dir / "postgres.log").stat().st_mode) == 0o600
        assert stat.S_IMODE(data_dir.stat().st_mode) & 0o066 == 0
    finally:
        assert stop_process(proc, sig=signal.SIGINT, timeout_s=60) == 0


def test_up_restarts_a_killed_postgres_and_the_admin_api_recovers(pg_tmp_path: Path) -> None:
    data_dir = pg_tmp_path / "data"
    log = pg_tmp_path / "up.log"
    port, admin_port = free_port(), free_port()
    proc = _start(data_dir, port, admin_port, log)
    try:
        info = _up_json(data_dir, proc, log)
        headers = {"Authorization": f"Bearer {info['admin_token']}"}
        models = f"{info['admin_url']}/admin/v1/models"
        assert httpx.post(models, json={"name": "kept"}, headers=headers).status_code == 201
        pidfile = data_dir / "postgres" / "postmaster.pid"
        old = int(pidfile.read_text().split()[0])
        os.kill(old, signal.SIGKILL)

        def new_postmaster() -> int | None:
            if proc.poll() is not None:
                raise AssertionError(f"llmgw up exited:\n{log.read_text()[-3000:]}")
            lines = pidfile.read_text().splitlines() if pidfile.exists() else []
            ready = len(lines) >= 8 and lines[7].strip() == "ready"
            return int(lines[0]) if ready and int(lines[0]) != old else None

        wait_for(new_postmaster, timeout_s=40, what="a new postmaster", interval_s=0.1)

        def model_back() -> bool:
            try:
                r = httpx.get(f"{models}/kept", headers=headers, timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and r.json()["name"] == "kept"

        wait_for(model_back, timeout_s=30, what="the admin API to serve the model again")
        assert httpx.get(f"{info['admin_url']}/readyz", timeout=5).status_code == 200
        # The admin API can reconnect while `pg.restart()` still polls for readiness, before
        # the launcher logs the restart: wait for the line rather than read the log once.
        wait_for(
            lambda: '"postgres_restarted"' in log.read_text(),
            timeout_s=15,
            what="the launcher to log the restart",
        )
        assert '"postgres_exited"' in log.read_text()
    finally:
        assert stop_process(proc, sig=signal.SIGINT, timeout_s=60) == 0
