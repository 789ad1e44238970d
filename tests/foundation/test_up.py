"""`llmgw up` end to end: embedded Postgres + migrations + control plane as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from support.procs import free_port, llmgw_cmd, stop_process, wait_for

pytestmark = pytest.mark.timeout(180)


def _up_args(data_dir: Path, port: int, admin_port: int) -> list[str]:
    return llmgw_cmd(
        "up",
        "--data-dir",
        str(data_dir),
        "--port",
        str(port),
        "--admin-port",
        str(admin_port),
        "--no-demo",
    )


def _start(data_dir: Path, port: int, admin_port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            _up_args(data_dir, port, admin_port),
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
        children = _pids_with(str(data_dir / "postgres")) | _pids_with(f"--port {admin_port}")
        assert len(children) >= 2, (
            children
        )  # the postmaster (and its workers) and the control plane
    finally:
        proc.kill()  # no chance to clean up: SIGKILL
        proc.wait()
    wait_for(
        lambda: not (_pids_with(str(data_dir / "postgres")) | _pids_with(f"--port {admin_port}")),
        timeout_s=30,
        what="Postgres and the control plane to stop after their supervisor was killed",
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
