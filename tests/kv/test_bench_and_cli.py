"""The benchmarks and the operator CLI, run as the real programs (tiny sizes: they must not rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from llmgw.kv import BlockStored, EventBatch, block_hashes, encode_batch, hash64

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, timeout=90, cwd=ROOT
    )


def test_kv_hash_bench_smoke() -> None:
    out = _run(["bench/kv_hash.py", "--tokens", "640", "--reps", "1"])
    assert out.returncode == 0, out.stderr.decode()
    doc = json.loads(out.stdout)
    assert doc["blocks"] == 40 and doc["targets"]["byte_identical"] is True
    assert set(doc["us_per_block"]) == {"cold", "warm", "naive", "sha256_floor"}


def test_kv_index_bench_smoke() -> None:
    args = ["--entries", "3000", "--shards", "4", "--prompt-blocks", "32", "--reps", "1"]
    out = _run(["bench/kv_index.py", *args])
    assert out.returncode == 0, out.stderr.decode()
    doc = json.loads(out.stdout)
    assert doc["entries"] == 3000 and set(doc["ratios"]) == {
        "ingest_index_over_floor",
        "memory_index_over_floor",
        "score_index_over_floor",
    }


def test_cli_hash_prints_one_line_per_full_block() -> None:
    tokens = json.dumps(list(range(1, 40))).encode()
    out = _run(["-m", "llmgw", "kv", "hash", "--seed", "1"], tokens)
    assert out.returncode == 0, out.stderr.decode()
    expected = block_hashes(list(range(1, 40)), 16, seed="1")
    assert out.stdout.decode().split() == [h.hex() for h in expected]
    args = ["-m", "llmgw", "kv", "hash", "--block-size", "4", "--seed", "1", "--int"]
    salted = _run([*args, "--cache-salt", "tenant-a"], json.dumps(list(range(1, 10))).encode())
    digests = block_hashes(list(range(1, 10)), 4, seed="1", cache_salt="tenant-a")
    assert salted.stdout.decode().split() == [str(hash64(d)) for d in digests]
    lora = _run(
        [*args, "--lora", "ad", "--lora-path", "/m/ad"], json.dumps(list(range(1, 10))).encode()
    )
    digests = block_hashes(list(range(1, 10)), 4, seed="1", lora_name="ad", lora_path="/m/ad")
    assert lora.stdout.decode().split() == [str(hash64(d)) for d in digests]


def test_cli_hash_rejects_bad_input() -> None:
    for stdin in (b"[1, 2", b'{"a": 1}', b"[1, -2]"):
        out = _run(["-m", "llmgw", "kv", "hash"], stdin)
        assert out.returncode == 2 and b"error:" in out.stderr
    out = _run(["-m", "llmgw", "kv", "hash", "--lora", "x"], b"[1]")
    assert out.returncode == 2 and b"lora_path" in out.stderr


def test_cli_decode_prints_events_as_json() -> None:
    digest = block_hashes(list(range(1, 17)), 16, seed="0")[0]
    batch = EventBatch(1.5, (BlockStored((digest,), None, tuple(range(1, 17)), 16, medium="GPU"),))
    payload = encode_batch(batch, shape="array", hash_form="bytes")
    out = _run(["-m", "llmgw", "kv", "decode"], payload)
    assert out.returncode == 0, out.stderr.decode()
    doc = json.loads(out.stdout)
    assert doc["events"][0]["block_hashes"] == [hash64(digest)]
    assert doc["events"][0]["type"] == "BlockStored" and doc["num_skipped"] == 0
    raw = _run(["-m", "llmgw", "kv", "decode", "--raw-hashes", "--hex"], payload.hex().encode())
    assert json.loads(raw.stdout)["events"][0]["block_hashes"] == [digest.hex()]
    bad = _run(["-m", "llmgw", "kv", "decode"], msgpack.packb({"not": "a batch"}))
    assert bad.returncode == 2 and b"malformed" in bad.stderr


def test_cli_applies_the_seed_and_block_size_rules_the_rest_of_llmgw_does() -> None:
    # Issue 8 item 7: `kv hash --seed abc` hashed happily; no engine can run with that seed.
    for seed in ("abc", "0", "042", "4294967296", "-1"):
        out = _run(["-m", "llmgw", "kv", "hash", "--seed", seed], b"[1, 2, 3]")
        assert out.returncode == 2, (seed, out.stdout)
        assert b"not a usable PYTHONHASHSEED" in out.stderr, out.stderr
    for size in ("0", "-4"):
        out = _run(["-m", "llmgw", "kv", "hash", "--block-size", size], b"[1, 2, 3]")
        assert out.returncode == 2 and b"--block-size" in out.stderr, out.stderr


def test_cli_decode_refuses_a_negative_block_size() -> None:
    event = ["BlockStored", [1], None, [1, 2], -16, None, "GPU"]
    out = _run(["-m", "llmgw", "kv", "decode"], msgpack.packb([1.0, [event], 0]))
    assert out.returncode == 2 and b"block_size is -16" in out.stderr, out.stderr
    offloaded = ["BlockStored", [1], None, [], 0, None, "CPU"]  # what offload events carry
    ok = _run(["-m", "llmgw", "kv", "decode"], msgpack.packb([1.0, [offloaded], 0]))
    assert ok.returncode == 0, ok.stderr
