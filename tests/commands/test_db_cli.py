"""`llmgw db` keeps the database password out of argv (issue 8 item 7)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from llmgw.commands.db import app
from tests.support.procs import free_port

PASSWORD = "hunter2-in-argv-hunter2"


def _invoke(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, list(args), env={"LLMGW_CONTROLPLANE__DATABASE_URL": None})
    return r.exit_code, r.stdout + r.stderr


def test_a_password_in_database_url_is_refused_naming_the_alternatives() -> None:
    url = f"postgresql://someone:{PASSWORD}@127.0.0.1:{free_port()}/nowhere"
    for cmd in ("current", "upgrade"):
        code, out = _invoke(cmd, "--database-url", url)
        assert code == 2, out
        assert "holds a password" in out and "--database-url-file" in out, out
        assert "LLMGW_CONTROLPLANE__DATABASE_URL" in out
        assert PASSWORD not in out


def test_the_url_file_and_a_passwordless_url_are_used(tmp_path: Path) -> None:
    port = free_port()
    secret_file = tmp_path / "db-url"
    secret_file.write_text(f"postgresql://someone:{PASSWORD}@127.0.0.1:{port}/nowhere\n")
    code, out = _invoke("current", "--database-url-file", str(secret_file))
    # It got as far as connecting, to the URL in the file, and hid the password.
    assert code == 2 and "cannot reach the database at" in out and str(port) in out, out
    assert PASSWORD not in out
    code, out = _invoke("current", "--database-url", f"postgresql://someone@127.0.0.1:{port}/x")
    assert code == 2 and "cannot reach the database at" in out, out
    two_lines = tmp_path / "two"
    two_lines.write_text(f"postgresql://a:{PASSWORD}@h/db\nsecond line\n")
    code, out = _invoke("current", "--database-url-file", str(two_lines))
    assert code == 2 and "must hold one line" in out and PASSWORD not in out, out
