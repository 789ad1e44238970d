"""Prefill/decode disaggregation across two real `llmgw simengine` processes sharing a directory:
a producer prefills (max_tokens 1), a consumer then loads the prompt's KV instead of computing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.simengine.sim_process import HASH_SEED, SimProcess

pytestmark = pytest.mark.e2e

BLOCK = 16
LONG = " ".join(f"clause {i} of the contract binds the tenant to term {i * 7}" for i in range(12))


def _transfer(role: str, path: Path) -> str:
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_rank": 0,  # vLLM's, accepted and ignored
            "kv_connector_extra_config": {"shared_storage_path": str(path)},
        }
    )


def _complete(sim: SimProcess, prompt: str, max_tokens: int) -> dict[str, object]:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens}
    r = httpx.post(f"{sim.base_url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert isinstance(usage, dict)
    return usage


def _counter(sim: SimProcess, name: str) -> float:
    text = httpx.get(f"{sim.base_url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    )


def test_a_consumer_loads_what_the_producer_prefilled(
    sim_factory: Callable[..., SimProcess], tmp_path: Path
) -> None:
    shared = tmp_path / "kv"
    shared.mkdir()
    common = ("--block-size", str(BLOCK))
    producer = sim_factory(*common, "--kv-transfer-config", _transfer("kv_producer", shared))
    consumer = sim_factory(*common, "--kv-transfer-config", _transfer("kv_consumer", shared))

    tokens = httpx.post(f"{consumer.base_url}/tokenize", json={"prompt": LONG}).json()["count"]
    full = (tokens - 1) // BLOCK * BLOCK
    assert full >= 4 * BLOCK, "the prompt must span several blocks"

    prefill = _complete(producer, LONG, 1)
    assert prefill["prompt_tokens_details"] == {"cached_tokens": 0}
    # The producer answered only after its blocks were stored: one file per full block.
    assert len([f for f in os.listdir(shared) if f.endswith(".kv")]) == tokens // BLOCK

    decode = _complete(consumer, LONG, 8)
    assert decode["prompt_tokens"] == tokens and decode["completion_tokens"] == 8
    assert decode["prompt_tokens_details"] == {"cached_tokens": full}

    other = _complete(consumer, "a different prompt that nobody prefilled " * 8, 4)
    assert other["prompt_tokens_details"] == {"cached_tokens": 0}

    assert _counter(consumer, "vllm:external_prefix_cache_hits_total") == full
    assert _counter(consumer, "vllm:external_prefix_cache_queries_total") == (
        tokens + other["prompt_tokens"]
    )
    # Loaded tokens are not local prefix-cache hits: vLLM counts the two apart.
    assert _counter(consumer, "vllm:prefix_cache_hits_total") == 0
    assert _counter(producer, "vllm:external_prefix_cache_hits_total") == 0


def test_a_missing_storage_dir_stops_the_engine_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "not-there"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "llmgw", "simengine", "--port", "1"),
            *("--kv-transfer-config", _transfer("kv_both", missing)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONHASHSEED": HASH_SEED},
    )
    assert proc.returncode == 2, proc.stderr
    assert str(missing) in proc.stderr and "is not a directory" in proc.stderr
