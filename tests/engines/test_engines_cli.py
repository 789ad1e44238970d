"""`llmgw engines command`, run as the real program an operator runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

KEY = "sk-cli-secret-key-0123456789"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "engines", "command", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def spec_doc(**profile: Any) -> dict[str, Any]:
    return {
        "replica_id": "rep-1",
        "shard_id": "shard-1",
        "http_port": 8100,
        "gpu_indices": [0, 1],
        "api_key": KEY,
        "runtime_dir": "/run/llmgw/shard-1",
        "profile": {"name": "p", "engine": "vllm", "model_path": "/m", "tp": 2, **profile},
    }


@pytest.mark.e2e
def test_prints_the_commands_as_json_with_the_key_redacted(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_doc()))
    r = run(str(path), env={"LLMGW_AGENT_TOKEN": "tok", "HF_HOME": "/hf"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"commands", "serves_http", "health_path", "metrics_path"}
    assert (out["serves_http"], out["health_path"], out["metrics_path"]) == (
        True,
        "/health",
        "/metrics",
    )
    [c] = out["commands"]
    assert set(c) == {"name", "path", "args", "env", "wait_for_leader_port"}
    assert c["env"]["VLLM_API_KEY"] == "<redacted>"
    assert c["env"]["HF_HOME"] == "/hf"  # inherited, as the agent would
    assert "LLMGW_AGENT_TOKEN" not in c["env"]
    assert KEY not in r.stdout
    assert c["args"][:2] == ["serve", "/m"]


@pytest.mark.e2e
def test_show_secrets_and_sglang_files(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec_doc(engine="sglang")))
    hidden = json.loads(run(str(path)).stdout)
    [f] = hidden["commands"][0]["files"]
    assert f == {
        "path": "/run/llmgw/shard-1/sglang-config.yaml",
        "mode": 0o600,
        "content": "<redacted>",
        "secret": True,
    }
    r = run(str(path), "--show-secrets")
    assert r.returncode == 0, r.stderr
    [f] = json.loads(r.stdout)["commands"][0]["files"]
    assert f["content"] == f'api-key: "{KEY}"\n'
    assert KEY not in " ".join(json.loads(r.stdout)["commands"][0]["args"])


@pytest.mark.e2e
def test_invalid_profiles_exit_2_with_the_message(tmp_path: Path) -> None:
    cases = {
        "unknown engine 'nope' (have": spec_doc(engine="nope"),
        "env may not set LD_PRELOAD": spec_doc(env={"LD_PRELOAD": "/x.so"}),
        "does not match TP 4": {**spec_doc(tp=4, nodes=2, gpus_per_node=1)},
        "sets --port": spec_doc(args=["--port=1"]),
    }
    for i, (message, doc) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(doc))
        r = run(str(path))
        assert r.returncode == 2, (message, r.stdout, r.stderr)
        assert message in r.stderr
        assert "Traceback" not in r.stderr
        assert r.stdout == ""


@pytest.mark.e2e
def test_validates_against_the_gpus_file(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_doc()))
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "memory_total_mb": 81559},
        {"index": 1, "name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "memory_total_mb": 81920},
    ]))  # fmt: skip
    r = run(str(spec), "--gpus", str(gpus))
    assert r.returncode == 2
    assert "GPUs are not uniform" in r.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    r = run(str(broken))
    assert r.returncode == 2
    assert "cannot read input" in r.stderr


# --- issue 8 item 7 (in-process through typer's runner: the same command, ~50x faster)


def run_inproc(*args: str, env: dict[str, str] | None = None) -> Any:
    from typer.testing import CliRunner

    from llmgw.commands.engines import app

    # Typer's runner swaps os.environ for `env` during the call, as a shell would.
    result = CliRunner().invoke(app, ["command", *args], env=env or {}, catch_exceptions=False)
    return subprocess.CompletedProcess(
        ["llmgw", "engines", "command", *args], result.exit_code, result.stdout, result.stderr
    )


SHELL_SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "aws-secret-in-the-operators-shell",
    "GITHUB_TOKEN": "ghp_token-in-the-operators-shell",
    "DATABASE_URL": "postgresql://u:db-password-in-shell@h/db",
    "SOME_UNRELATED_VAR": "unrelated-value-in-shell",
}


@pytest.mark.e2e
def test_the_callers_secrets_are_never_printed(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    doc = spec_doc(env={"WANDB_API_KEY": "wandb-key-in-the-profile"})
    path.write_text(json.dumps(doc))
    for extra in ((), ("--show-secrets",)):
        r = run_inproc(str(path), *extra, env={**SHELL_SECRETS, "HF_HOME": "/hf"})
        assert r.returncode == 0, r.stderr
        for value in SHELL_SECRETS.values():
            # Not inherited at all: the base environment is an allow-list.
            assert value not in r.stdout, (extra, value)
        [c] = json.loads(r.stdout)["commands"]
        assert c["env"]["HF_HOME"] == "/hf"
        assert "PATH" in c["env"]
    # A secret-looking variable the profile sets is shown only on request.
    hidden = json.loads(run(str(path)).stdout)["commands"][0]
    assert hidden["env"]["WANDB_API_KEY"] == "<redacted>"
    shown = json.loads(run(str(path), "--show-secrets").stdout)["commands"][0]
    assert shown["env"]["WANDB_API_KEY"] == "wandb-key-in-the-profile"


def test_errors_name_the_place_never_the_content(tmp_path: Path) -> None:
    secret = "s3cr3t-hash-$6$abcdefgh"
    cases = {
        # An /etc/shadow-like file: YAML reads it as one string.
        "shadow": f"root:{secret}:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
        # A YAML syntax error on a line holding a secret.
        "broken.yaml": f"replica_id: r\nprofile: [{secret}\n",
        # A JSON syntax error after one.
        "broken.json": f'{{"api_key": "{secret}", nope}}',
        # A valid document with the secret where a seed belongs.
        "seed.json": json.dumps(spec_doc(kv_hash={"seed": secret})),
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        r = run_inproc(str(path))
        assert r.returncode == 2, (name, r.stderr)
        assert secret not in r.stderr and secret not in r.stdout, (name, r.stderr)
        assert "Traceback" not in r.stderr
        assert str(path) in r.stderr, (name, r.stderr)
    r = run_inproc(str(tmp_path / "broken.yaml"))
    assert "at line 3, column 1" in r.stderr


def test_a_deeply_nested_spec_is_a_clear_error(tmp_path: Path) -> None:
    for name, text in (
        ("deep.json", "[" * 100_000 + "]" * 100_000),
        ("deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000),
    ):
        path = tmp_path / name
        path.write_text(text)
        r = run_inproc(str(path))
        assert r.returncode == 2, (name, r.stderr[-500:])
        assert "Traceback" not in r.stderr and "RecursionError" not in r.stderr
        assert "nests too deeply" in r.stderr or "holds a list" in r.stderr, r.stderr[-500:]


EXAMPLES = Path(__file__).resolve().parents[2] / "config" / "examples"


def test_every_example_spec_is_accepted() -> None:
    from llmgw.engines import ENGINE_NAMES

    found = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))
    assert found == sorted(ENGINE_NAMES)
    for path in sorted(EXAMPLES.glob("*.yaml")):
        r = run_inproc(str(path), "--clean-env")
        assert r.returncode == 0, (path.name, r.stderr)
        out = json.loads(r.stdout)
        assert out["commands"], path.name
        assert "sk-example-not-a-real-key" not in r.stdout  # redacted
        doc = yaml.safe_load(path.read_text())
        assert doc["profile"]["engine"] == path.stem
