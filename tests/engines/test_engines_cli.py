"""`llmgw engines command`, run as the real program an operator runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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
