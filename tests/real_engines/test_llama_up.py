"""The README's "A real model on the CPU" example, as written: `llmgw up` with llama-server
on its PATH, config/llama-cpu.yaml applied with its model_path pointed at a GGUF, and the
model answering chat through the OpenAI endpoint beside the demo."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.procs import llmgw_cmd
from tests.support.waiting import wait_for
from tests.up.up_harness import Up

pytestmark = [pytest.mark.real_engine, pytest.mark.e2e, pytest.mark.timeout(180)]

_EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "llama-cpu.yaml"


def test_the_readme_llama_example_serves_through_up(
    pg_tmp_path: Path, llama_server: str, tiny_gguf: Path
) -> None:
    path = f"{Path(llama_server).parent}:{os.environ.get('PATH', '')}"
    up = Up.new(pg_tmp_path).start(env={"PATH": path})
    try:
        info = up.wait_up()
        document = _EXAMPLE.read_text()
        assert "model_path: /models/model.gguf" in document  # what the README's sed replaces
        # As the README's shell would: no admin settings, the up's own up.json names them.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        applied = subprocess.run(
            llmgw_cmd("apply", "-f", "-", "--data-dir", str(up.data_dir)),
            input=document.replace("/models/model.gguf", str(tiny_gguf)),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert applied.returncode == 0, applied.stdout + applied.stderr
        body = {"model": "local", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        headers = {"Authorization": f"Bearer {info['api_key']}"}

        def answered() -> httpx.Response | None:
            r = httpx.post(
                f"{info['base_url']}/chat/completions", json=body, headers=headers, timeout=30
            )
            return r if r.status_code == 200 else None

        reply = wait_for(
            answered, timeout_s=90, what="the llama.cpp model to answer", interval_s=0.5
        )
        usage = reply.json()["usage"]
        assert usage["prompt_tokens"] > 3 and 1 <= usage["completion_tokens"] <= 4
    finally:
        assert up.stop() == 0
