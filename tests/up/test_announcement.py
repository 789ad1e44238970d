"""What `llmgw up` prints once it is up: every command in it runs in a newcomer's shell, whose
PATH has neither the virtual environment's `llmgw` nor a Python with the openai client."""

from __future__ import annotations

import sys
from pathlib import Path

from llmgw.up.bootstrap import Commands, announcement


def _printed(commands: Commands, agent_metrics: list[tuple[str, str]] | None = None) -> str:
    return announcement(
        base_url="http://127.0.0.1:8080/v1",
        api_key="llmgw_0123456789abcdef_secret",
        admin_url="http://127.0.0.1:8081",
        admin_token="t" * 32,
        data_dir=Path("/data dir"),
        psql="psql postgresql://llmgw_app@127.0.0.1:5432/llmgw",
        models=["demo", "demo-sql"],
        took_s=1.0,
        commands=commands,
        agent_metrics=agent_metrics or [],
    )


def test_commands_name_the_environments_python_and_llmgw_by_path() -> None:
    text = _printed(Commands("/x/.venv/bin/python", "/x/.venv/bin/llmgw", has_openai=True))
    lines = text.splitlines()[2:]  # after "llmgw is up (...)", which is no command
    assert "/x/.venv/bin/python - <<'PY'" in lines
    assert "  Status:           /x/.venv/bin/llmgw status --data-dir '/data dir'" in lines
    for line in lines:
        assert not line.lstrip().startswith(("python3 ", "python ", "llmgw ", "pip ")), line
    assert "pip install" not in text  # the client is there already


def test_a_missing_openai_client_is_installed_into_that_environment_first() -> None:
    text = _printed(Commands("/x/.venv/bin/python", "/x/.venv/bin/llmgw", has_openai=False))
    lines = text.splitlines()
    install = lines.index("/x/.venv/bin/python -m pip install -q openai")
    assert install < lines.index("/x/.venv/bin/python - <<'PY'")


def test_the_agents_metrics_urls_are_printed() -> None:
    text = _printed(
        Commands("/p", "/l", has_openai=True),
        [("h-sim", "http://127.0.0.1:40001/metrics"), ("h", "http://127.0.0.1:40002/metrics")],
    )
    assert "  Agent metrics:    http://127.0.0.1:40001/metrics   (node h-sim)" in text
    assert "  Agent metrics:    http://127.0.0.1:40002/metrics   (node h)" in text


def test_this_process_is_described_by_its_own_paths() -> None:
    here = Commands.of_this_process()
    assert here.python == sys.executable
    # The test suite runs from the dev install: llmgw beside the interpreter, openai in it.
    assert here.llmgw == str(Path(sys.executable).with_name("llmgw"))
    assert here.has_openai


def test_the_console_url_is_printed() -> None:
    text = _printed(Commands("/p", "/l", has_openai=True))
    line = "  Console:          http://127.0.0.1:8081/ui/   (sign in with the admin token)"
    assert line in text.splitlines()
