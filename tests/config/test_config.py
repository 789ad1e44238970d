"""Settings: TOML file, LLMGW_* environment overrides, and errors that name the key, value and rule."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from llmgw.config import load_settings
from llmgw.errors import ConfigError
from tests.support.procs import free_port, llmgw_cmd

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "llmgw.toml"


def test_the_documented_example_loads_with_its_defaults() -> None:
    s = load_settings(EXAMPLE)
    assert s.controlplane.internal_port == 8081
    assert s.gateway.port == 8080
    assert s.log.level == "info"


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[controlplane]\ninternal_port = 9000\ndatabase_url = "postgresql://u@h/db"\n')
    assert load_settings(cfg).controlplane.internal_port == 9000
    # postgresql:// is normalised to the psycopg 3 driver we ship.
    assert load_settings(cfg).controlplane.database_url == "postgresql+psycopg://u@h/db"
    monkeypatch.setenv("LLMGW_CONTROLPLANE__INTERNAL_PORT", "9100")
    assert load_settings(cfg).controlplane.internal_port == 9100
    assert (
        load_settings(cfg, controlplane={"internal_port": 9200}).controlplane.internal_port == 9200
    )


@pytest.mark.parametrize(
    ("toml", "needles"),
    [
        (
            "[controlplane]\ninternal_port = 70000\n",
            ["controlplane.internal_port", "70000", "65535"],
        ),
        ("[controlplane]\nadmin_tokn = 'x'\n", ["controlplane.admin_tokn", "unknown setting"]),
        ("[log]\nlevel = 'loud'\n", ["log.level", "'loud'", "debug"]),
        (
            "[controlplane]\ndatabase_url = 'sqlite:///x.db'\n",
            ["database_url", "postgresql+psycopg://"],
        ),
        ("[controlplane]\nadmin_token = 'short'\n", ["admin_token", "16 characters", "<hidden>"]),
        ("[controlplane\n", ["cannot read config file"]),
    ],
)
def test_invalid_values_name_key_value_and_rule(
    tmp_path: Path, toml: str, needles: list[str]
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    for needle in needles:
        assert needle in err.value.message
    # Secrets never appear in the message, whatever else it says.
    assert "'short'" not in err.value.message


def test_missing_config_file_is_named() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings("/nonexistent/llmgw.toml")


@pytest.mark.e2e
def test_controlplane_refuses_to_start_without_a_database_or_token(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[controlplane]\nadmin_token = "0123456789abcdef"\n')
    done = subprocess.run(
        llmgw_cmd("controlplane", "--config", str(cfg)), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "LLMGW_CONTROLPLANE__DATABASE_URL" in done.stderr
    assert "Traceback" not in done.stderr
    cfg.write_text("[controlplane]\ninternal_port = -1\n")
    done = subprocess.run(
        llmgw_cmd("controlplane", "--config", str(cfg)), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "controlplane.internal_port" in done.stderr


@pytest.mark.e2e
def test_db_commands_report_an_unreachable_database_without_a_trace() -> None:
    url = f"postgresql://someone:hunter2hunter2@127.0.0.1:{free_port()}/nowhere"
    for cmd in (["db", "current"], ["db", "upgrade"]):
        # The URL comes from the environment: a password in argv is refused (visible in `ps`).
        done = subprocess.run(
            llmgw_cmd(*cmd),
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "LLMGW_CONTROLPLANE__DATABASE_URL": url},
        )
        assert done.returncode == 2, done.stderr
        assert "cannot reach the database at" in done.stderr and "Traceback" not in done.stderr
        assert "hunter2hunter2" not in done.stderr


def test_database_passwords_are_not_echoed_in_config_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLMGW_CONTROLPLANE__DATABASE_URL", "mysql://u:S3CRETPW@h/db")
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert "S3CRETPW" not in err.value.message and "mysql://u:***@h/db" in err.value.message
